"""The demo's own helpers, apart from the library: the demo models (:mod:`.models`: MiniLM,
SmolLM2-135M, loading any Hugging Face folder, perplexity and embeddings), the corpora they
are calibrated and evaluated on (:mod:`.data`: gensim's Lee corpus), and the synthetic
format table (:mod:`.formats`, ``python -m quantscope.demo``)."""
