"""llamacpp-logits (logits.cpp) and the comparison of its runs (compare.py)."""
