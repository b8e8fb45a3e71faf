"""Model pieces that drive an executor's graphs: the tokenizer, the vision encoder, the LLM backbone
(buckets, chunked prefill, decode) and the heads. They import the contract (``core``), never a backend."""
