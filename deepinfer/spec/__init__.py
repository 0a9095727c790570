"""Speculative decoding's host-side planning (numpy, no torch): draft proposers (prompt lookup), the
confidence scheduler that sizes each request's verify block, the speculation counters and the
calibration of draft confidences. The engine's scheduler imports it; it imports nothing from the
engine or the worker. Verification of the drafts against the target forward runs on the device, in
worker/verify.py."""
