"""`pdserve bench`: `serve` drives any OpenAI-compatible endpoint; `pd` runs the seed's before/after experiment."""
