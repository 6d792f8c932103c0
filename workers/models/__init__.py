"""Model families, one file each, built from a Hugging Face config."""
