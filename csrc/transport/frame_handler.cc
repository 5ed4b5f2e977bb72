#include "transport/frame_handler.h"

#include <algorithm>
#include <cstring>

namespace bagpipe::transport {

namespace wire = protocol::wire;

bool ServerLink::SendError(uint64_t tag, uint32_t slot, wire::Status status, uint64_t session_id,
                           const std::string& text) {
  const size_t n = std::min(text.size(), wire::kMaxMessageBytes);
  wire::MessageBody body{};
  body.session = session_id;
  body.text_len = static_cast<uint32_t>(n);
  return Send(wire::MsgType::kError, status, tag, slot, &body, sizeof(body), n,
              [&](uint8_t* dst) { std::memcpy(dst, text.data(), n); });
}

}  // namespace bagpipe::transport
