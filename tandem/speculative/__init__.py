"""Speculative decoding: proposers that guess a request's next tokens without a model, and the
policy that decides, per request and per step, how many of those guesses a step verifies."""
