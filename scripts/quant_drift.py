"""Greedy drift from fp32 (tests/test_bf16_fidelity.py metric) of simulated int8 schemes in transformers:
per-channel/per-token (what --quantization int8 runs today), a faithful Q8_0 (blocks of 32, fp16 scales,
activations in blocks of 32), and grouped variants. Decides the group size the kernel needs.

    python scripts/quant_drift.py   # about 3 min on 2 cores
"""
import sys, torch, time
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))) + "/tests"); sys.path.insert(0, "/work/wt-quant")
from conftest import hf_greedy
from test_bf16_fidelity import QUESTIONS, mean_leading_matches
from transformers import AutoModelForCausalLM, AutoTokenizer
import torch.nn.functional as F
path = "/root/.cache/tokenloom/models/SmolLM2-135M-Instruct"
tok = AutoTokenizer.from_pretrained(path)
prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False) for q in QUESTIONS]
torch.set_num_threads(1)

def q_rows(w, group):  # symmetric int8 along the last dim, groups of `group` (None: whole row)
    shape = w.shape
    g = w.reshape(*shape[:-1], -1, group) if group else w.unsqueeze(-2)
    s = g.abs().amax(-1, keepdim=True) / 127
    if group: s = s.half().float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    return ((g / s).round().clamp(-127, 127) * s).reshape(shape)

def make_forward(wq, agroup):
    def fwd(x):
        return F.linear(q_rows(x, agroup), wq)
    return fwd

def run(scheme):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if scheme:
        wgroup, agroup, head = scheme
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and (head or name != "lm_head"):
                wq = q_rows(m.weight.data, wgroup)
                m.forward = make_forward(wq, agroup)
        if head:
            emb = model.model.embed_tokens
            emb.weight = torch.nn.Parameter(q_rows(emb.weight.data, wgroup))
            # head keeps its own quantized copy via the forward above (computed before this)
    return [hf_greedy(model, p, 32) for p in prompts]

t=time.time()
ref = run(None); print("fp32", time.time()-t, flush=True)
for name, scheme in [("chan+token, head bf16", (None, None, False)), ("chan+token, head int8", (None, None, True)),
                     ("Q8_0", (32, 32, True)), ("g32 W, token A", (32, None, True)), ("g64+g64", (64,64,True))]:
    out = run(scheme)
    print(name, mean_leading_matches(out, ref), [ __import__('test_bf16_fidelity').leading_matches(a,r) for a,r in zip(out,ref)], flush=True)
