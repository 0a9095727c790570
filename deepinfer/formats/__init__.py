"""Number formats: DeepSeek's FP8 / FP4 weight blocks and V4.1's per-group cache formats.
The lowest package: it imports nothing from deepinfer."""
