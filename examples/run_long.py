"""Load a resized checkpoint and run it on an input as long as its new context.

    python examples/run_long.py minilm-2k
"""

import sys

import torch
from transformers import AutoModel, AutoTokenizer

path = sys.argv[1] if len(sys.argv) > 1 else "minilm-2k"
tokenizer = AutoTokenizer.from_pretrained(path)
model, info = AutoModel.from_pretrained(path, output_loading_info=True)
problems = {k: v for k, v in info.items() if v}
print(f"loaded {path}: {'clean' if not problems else problems}")

text = "posextend gives learned position tables a longer context. " * 1000
batch = tokenizer(text, return_tensors="pt", truncation=True)  # truncates at the new model_max_length
with torch.no_grad():
    out = model(**batch)
print(f"tokenizer.model_max_length = {tokenizer.model_max_length}")
print(f"input {tuple(batch['input_ids'].shape)} -> last_hidden_state {tuple(out[0].shape)}")
