"""Performance gating: statistics of an effect, and the interleaved A/B runner that feeds them."""
