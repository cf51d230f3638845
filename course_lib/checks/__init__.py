"""Exercise checkers, one module per lab: they print a specific hint when an answer is wrong."""
