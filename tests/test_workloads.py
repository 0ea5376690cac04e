"""Seeded length samplers."""
import numpy as np
import pytest

from liquidcp_jax.workloads import DATASETS, get_distribution, parse_tokens, sample_batch


@pytest.mark.parametrize("dataset", sorted(DATASETS))
@pytest.mark.parametrize("tokens", ["64K", 131072, "256k"])
def test_batch_fills_budget(dataset, tokens):
    b = sample_batch(dataset, tokens, 7)
    assert b.dtype == np.int64 and b.ndim == 1
    assert int(b.sum()) == parse_tokens(tokens)
    assert b.min() >= 1 and b.max() <= parse_tokens(tokens)


def test_seeded_and_distinct():
    a = sample_batch("freelaw", "128K", 3)
    np.testing.assert_array_equal(a, sample_batch("freelaw", "128K", 3))
    assert not np.array_equal(a, sample_batch("freelaw", "128K", 4))
    assert not np.array_equal(sample_batch("github", "128K", 3)[:5],
                              sample_batch("pilecc", "128K", 3)[:5])


def test_parse_tokens():
    assert parse_tokens("64K") == 65536 and parse_tokens(65536) == 65536
    assert parse_tokens("1M") == 1 << 20
    for bad in ["64Q", "", -1, 0, 1.5, True]:
        with pytest.raises(ValueError, match="tokens"):
            parse_tokens(bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="dataset"):
        sample_batch("wikipedia", "64K", 0)
    with pytest.raises(ValueError, match="seed"):
        sample_batch("freelaw", "64K", -1)
    assert get_distribution("Pile-CC").name == "pilecc"


def test_documented_means():
    # The fits target the Pile-paper means: Pile-CC ~1.06K, GitHub ~1.7K, FreeLaw ~3.6K, ArXiv ~14.5K.
    rng = np.random.default_rng(0)
    targets = {"pilecc": 1060, "github": 1680, "freelaw": 3590, "arxiv": 14460}
    for name, mean in targets.items():
        x = DATASETS[name].sample(rng, 200_000, 1 << 20)
        assert abs(x.mean() / mean - 1) < 0.15, (name, x.mean())


def test_prolong_long_share():
    # ~60 % of ProLong tokens sit in 64K documents (the 6:4 long/short mix).
    lengths = np.concatenate([sample_batch("prolong", "256K", s) for s in range(40)])
    share = lengths[lengths == 65536].sum() / lengths.sum()
    assert 0.4 < share < 0.8
    # Documents longer than the context are cut into context-sized pieces.
    b = sample_batch("arxiv", "64K", 0, context=8192)
    assert b.max() <= 8192 and b.sum() == 65536
