"""Test and benchmark tools of torchrec_bagpipe (not part of its API)."""
