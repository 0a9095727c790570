"""Speculative decoding: draft proposers, the confidence scheduler that sizes each request's verify
block, and the verification step that accepts drafted tokens against one target forward."""
