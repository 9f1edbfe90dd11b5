"""Structured outputs (guided decoding): a grammar's bitmask on the logits at every step.

params.py is pure Python (it travels inside SamplingParams); backends.py wraps xgrammar and
llguidance; manager.py compiles grammars off the step loop for the engine core; bitmask.py is
the model runner's half. Import the modules, not this package: it stays free of torch.
"""
