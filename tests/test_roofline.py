"""The roofline fit recovers known α/β from synthetic timings."""
import numpy as np

from conftest import tiny_loaded
from fastspec.graphs.keys import GraphKey, batch_bucket
from fastspec.graphs.roofline import Roofline, fit_roofline, forward_bytes, forward_flops


def test_fit_recovers_known_alpha_beta():
    cfg = tiny_loaded().cfg.replace(hidden_size=576, intermediate_size=1536, num_layers=30,
                                    num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152)
    truth = Roofline(alpha_c=2.5, beta_c=0.004, alpha_m=1.4, beta_m=0.002,
                     peak_flops=200e9, bandwidth=40e9)
    pts = [(b, n, c) for b in (1, 4, 16) for n in (1, 2, 4, 8, 16, 32, 64) for c in (256, 1024)]
    f = np.array([forward_flops(cfg, b, n, c) for b, n, c in pts])
    m = np.array([forward_bytes(cfg, b, n, c) for b, n, c in pts])
    rng = np.random.default_rng(0)
    t = truth.predict(f, m) * (1 + 0.01 * rng.standard_normal(len(pts)))
    fit = fit_roofline(f, m, t, truth.peak_flops, truth.bandwidth)
    for name in ("alpha_c", "alpha_m"):
        assert abs(getattr(fit, name) / getattr(truth, name) - 1) < 0.05, (name, fit)
    assert abs(fit.beta_c - truth.beta_c) < 0.002 and abs(fit.beta_m - truth.beta_m) < 0.001, fit
    assert np.max(np.abs(fit.predict(f, m) / truth.predict(f, m) - 1)) < 0.05


def test_batch_buckets_and_keys():
    assert [batch_bucket(n) for n in (1, 3, 5, 8, 9, 100)] == [1, 4, 8, 8, 16, 128]
    k = GraphKey(4, 16, "chain")
    assert k == GraphKey(4, 16, "chain") and hash(k) == hash(GraphKey(4, 16, "chain"))
    assert len({k, GraphKey(4, 16, "chain"), GraphKey(8, 16, "chain")}) == 2
