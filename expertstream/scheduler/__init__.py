"""The scheduler: splits, the stock copy path and the lookahead staging ring."""
