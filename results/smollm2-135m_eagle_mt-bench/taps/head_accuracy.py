# A one-off diagnostic (Dec 1, 2026): the columns are top-1 / top-2 / top-4 accuracy of draft step 1 and the
# rate at which the first two / three chained draft tokens are all right, on answer positions.
"""MT-bench answers: a head's top-k accuracy at draft steps 1-2 and its chain acceptance (cumulative), via unrolled."""
import sys, torch
from specdec import load_model
from specdec.workloads import load_workload
from specdec.head import load_head
from specdec.train import _batched_generate, _pad_id
from specdec.cache import LeanKVCache
torch.set_num_threads(2)
t = load_model("smollm2-135m")
cats = "writing,roleplay,reasoning,math,coding,extraction,stem,humanities".split(",")
ps = load_workload("/work/shared/workloads/spec_bench_dev.jsonl", cats, limit=int(sys.argv[2]) if len(sys.argv) > 2 else 1)
head, _ = load_head(sys.argv[1], t.lean().hidden_size)
index = torch.full((t.vocab_size,), -1, dtype=torch.long); index[head.vocab_ids] = torch.arange(len(head.vocab_ids))
embed = t.lean().embed
outw = t.hf.get_output_embeddings().weight.detach()[head.vocab_ids].float()
allr = []
for p in ps:
    ids = t.encode(p.text, chat=True)
    ans = _batched_generate(t, [ids], _pad_id(t), do_sample=False, max_new_tokens=128)[0]
    tokens = ids + ans
    kv = LeanKVCache(t, capacity=len(tokens), taps=head.taps); logits = kv.extend(tokens)
    feats = kv.features[:len(tokens)].float().clone(); tid = index[logits.argmax(-1)[1:]]
    with torch.no_grad():
        preds = head.unrolled(feats[:-1], embed[torch.tensor(tokens[1:])].float(), 3)
    ranks = []
    for pred in preds:
        lg = pred @ outw.T
        r = (lg > lg.gather(1, tid.clamp(min=0)[:, None])).sum(1); r[tid < 0] = 10**6; ranks.append(r)
    L, T = len(ids), len(tokens) - 1
    rows = torch.arange(L - 1, T - 2)
    c1 = ranks[0][rows] == 0; c2 = c1 & (ranks[1][rows + 1] == 0); c3 = c2 & (ranks[2][rows + 2] == 0)
    res = [float((ranks[0][rows] < k).float().mean()) for k in (1, 2, 4)] + [float(c2.float().mean()), float(c3.float().mean())]
    allr.append(res)
    print(p.category, " ".join(f"{x:.2f}" for x in res), flush=True)
m = [sum(r[i] for r in allr) / len(allr) for i in range(5)]
print("mean top1/top2/top4 step1, chain2, chain3:", " ".join(f"{x:.3f}" for x in m))
