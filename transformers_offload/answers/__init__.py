"""Answers from a recording (transition scores, logprobs, tables...): these modules only read."""
