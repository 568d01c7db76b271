//! # semlb-workers
//!
//! The inference-worker side of semlb. This crate will hold the simulated
//! OpenAI-compatible engine (prefix KV cache, continuous batching, vLLM-style
//! metrics) that tests and benchmarks route to on machines without GPUs
//! (issue 3), and `workers/recipes/` the launch recipes for real engines
//! (vLLM, SGLang, llama.cpp).
//!
//! Nothing is implemented here yet: the crate exists so the workspace has the
//! layout the project asked for from the first commit.
