"""Real models from GGUF files: reading GGUF (gguf_file), its tokenizer (gguf_tokenizer), the conversion
to a Hugging Face folder (gguf_to_hf) and the catalogue behind `batchinfer get-model` (get_model)."""
