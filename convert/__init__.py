"""mixrl weight formats: HF safetensors I/O, quantized exports, manifests, the converter CLI."""
