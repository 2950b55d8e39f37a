"""Models: the built-in tokenizer and models, loading from paths or hub ids, log-prob helpers."""
