"""Random-weight models with the real configs and tokenizers (no weights can reach the GPU machine).
Logits spread x20 (as the tests' models) so argmax near-ties are rare; EOS rows zeroed so runs keep going."""
import shutil, sys, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = Path(".gpu/cfg"), Path(sys.argv[1])
shutil.copy(src / "qwen2.5-coder-1.5b/tokenizer.json", src / "qwen2.5-coder-0.5b/tokenizer.json")
for name, dtype in (("smollm2-135m", torch.float32), ("qwen2.5-coder-1.5b", torch.bfloat16), ("qwen2.5-coder-0.5b", torch.bfloat16)):
    cfg = AutoConfig.from_pretrained(src / name)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    with torch.no_grad():
        w = m.get_output_embeddings().weight
        w.mul_(20)
        eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
        for e in eos + [151643, 151645]:
            if e is not None and e < w.shape[0]:
                w[e] = 0
    out = dst / f"{name}-random"
    m.save_pretrained(out)
    for f in (src / name).iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    print(name, sum(p.numel() for p in m.parameters()) / 1e6, "M params ->", out, flush=True)
