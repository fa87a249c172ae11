"""Multimodal inputs (images) for vision-language models: media loading, processing, the encoder cache."""
