"""Helpers shared by several test files: fake steps with prepared logits, hand-built models,
exact and empirical laws, and reference logits for checkpoints."""
from collections import Counter

import torch

from conftest import tiny_loaded
from fastspec.convention import FASTSPEC
from fastspec.draft import AdapterConfig, attach_adapter
from fastspec.layout import cache_mask, causal_block
from fastspec.model.llama import LlamaModel
from fastspec.sampling import SamplerState

# The fake vocabulary of FakeStep tests: ids 0..9, MASK = 10, EOS = 9.
V, MASK, EOS = 10, 10, 9


def logits_from(probs: dict[int, float]) -> torch.Tensor:
    """A row of logits whose softmax puts `probs` on those ids and spreads the rest evenly."""
    rest = (1 - sum(probs.values())) / (V - len(probs))
    p = torch.full((V,), rest)
    for t, q in probs.items():
        p[t] = q
    return p.log()


class FakeStep:
    """Hands out prepared logits per forward and records what each forward was given."""

    def __init__(self, outputs, width, convention=FASTSPEC):
        self.outputs, self.width, self.convention = list(outputs), width, convention
        self.sampler = SamplerState(1)
        self.mask_token_id = MASK
        self.calls = []

    def forward(self, ids, block_mask, adapter_on=None, rel_positions=None):
        self.calls.append(dict(ids=ids, mask=block_mask, adapter=adapter_on, rel=rel_positions))
        return self.outputs.pop(0)


def copy_model(vocab=32, scale=3.0):
    """Each token mostly predicts itself (embeddings nearly orthogonal, attention averages the
    prefix), and a MASK (zero embedding) predicts what the prefix repeats: drafts are accepted
    and branches are hit, and sampling still has room to disagree."""
    t = tiny_loaded(seed=3, layers=1, vocab_size=vocab)
    m = t.model
    attach_adapter(m, AdapterConfig(rank=2), seed=3)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        d = m.cfg.hidden_size
        m.embed.copy_(torch.randn(vocab, d, generator=g) * scale / d ** 0.5)
        blk = m.layers[0]
        blk.attn.wqkv.zero_()
        q = m.cfg.num_heads * m.cfg.head_dim
        kv = m.cfg.num_kv_heads * m.cfg.head_dim
        blk.attn.wqkv[q + kv:] = torch.eye(kv, d)
        blk.attn.wo.zero_()
        for h in range(m.cfg.num_heads):               # every head reads its kv group's values
            grp = h // (m.cfg.num_heads // m.cfg.num_kv_heads)
            blk.attn.wo[grp * m.cfg.head_dim:(grp + 1) * m.cfg.head_dim,
                        h * m.cfg.head_dim:(h + 1) * m.cfg.head_dim] = torch.eye(m.cfg.head_dim) / 2
        blk.mlp.w_down.zero_()
        m.mask_embed.zero_()
        for norm in (blk.attn_norm, blk.mlp_norm, m.norm):
            norm.weight.fill_(1.0)
    m.requires_grad_(False)
    return t


def exact_pair_law(engine, prompt, first: int, second: int, depth: int):
    """P(x_first, x_second) of AR sampling at temperature 1, by enumerating every continuation
    up to `depth` tokens (the vocab is tiny)."""
    V = engine.cfg.vocab_size
    engine.prepare(1, len(prompt) + depth + 1)
    c = engine.cache
    law = torch.zeros(V, V)

    def visit(tokens, p):
        if len(tokens) == depth:
            law[tokens[first], tokens[second]] += p
            return
        ids = prompt + tokens
        c.lengths.zero_()
        probs = torch.softmax(engine.forward(torch.tensor([ids]), causal_block(len(ids)))[0, -1], -1)
        for x in range(V):
            visit(tokens + [x], p * probs[x].item())

    visit([], 1.0)
    return law


def tv(a: list, b: list) -> float:
    ca, cb = Counter(a), Counter(b)
    return 0.5 * sum(abs(ca[k] / len(a) - cb[k] / len(b)) for k in ca.keys() | cb.keys())


def null_quantile(a: list, b: list, q: float = 0.999, perms: int = 400) -> float:
    """The q-quantile of TV between random halves of the pooled samples (law under "same law")."""
    codes = {x: i for i, x in enumerate(set(a) | set(b))}
    pooled = torch.tensor([codes[x] for x in a + b])
    g = torch.Generator().manual_seed(0)
    dists = []
    for _ in range(perms):
        p = pooled[torch.randperm(len(pooled), generator=g)]
        ha = torch.bincount(p[: len(a)], minlength=len(codes)) / len(a)
        hb = torch.bincount(p[len(a):], minlength=len(codes)) / len(b)
        dists.append(0.5 * (ha - hb).abs().sum().item())
    return torch.tensor(dists).quantile(q).item()


def first(samples, k):
    return [s[:k] for s in samples]


IDS = torch.tensor([[5, 17, 300, 42, 9, 77, 123, 4, 250, 11, 64, 3],
                    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])


def native_logits(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    """Prefill from an empty cache: positions = write columns = 0..N-1, causal mask."""
    B, N = ids.shape
    c = model.cfg
    k = torch.zeros(c.num_layers, B, c.num_kv_heads, N, c.head_dim, dtype=model.embed.dtype)
    pos = torch.arange(N).expand(B, N)
    mask = cache_mask(torch.zeros(B, dtype=torch.long), causal_block(N), N)
    with torch.no_grad():
        return model(ids, pos, k, torch.zeros_like(k), pos, mask, torch.arange(B))


def hf_logits(directory, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits


def prefilled_engine(loaded, prefix, max_len=64):
    """An eager engine with one slot whose committed prefix is `prefix` (its K/V in the cache)."""
    from fastspec.engine import Engine
    engine = Engine(loaded, backend="eager")
    engine.prepare(1, max_len)
    engine.cache.lengths.zero_()
    engine.forward(torch.tensor([list(prefix)]), causal_block(len(prefix)))
    engine.cache.lengths[0] = len(prefix)
    return engine


def look_as_if_perfect(monkeypatch) -> None:
    """Judge every look as if no request had drafted yet (every draft accepted): a tiny random
    drafter's best, ~2 tokens a round, could never pay, and its runs would stop looking, where
    a test wants runs that mix AR and drafting rounds (fastspec/methods/ar_rounds.py)."""
    from fastspec.methods import ar_rounds
    monkeypatch.setattr(ar_rounds.DraftMeans, "best", property(lambda self: None))
