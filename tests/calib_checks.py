"""Comparisons of two calibrations, and calibration data, that several test files share."""

import torch


def assert_same_qparams(a, b) -> None:
    """``a`` and ``b`` (Calibrations) hold the same layers and roles, and bitwise the same
    scales and zero points (and there is something to compare)."""
    assert a.states.keys() == b.states.keys() and a.states
    for layer, roles in a.states.items():
        assert roles.keys() == b.states[layer].keys(), layer
        for role, st in roles.items():
            qa, qb = st.qparams, b.states[layer][role].qparams
            assert torch.equal(qa.scale, qb.scale), (layer, role)
            assert torch.equal(qa.zero_point, qb.zero_point), (layer, role)


def padded_batches() -> list[dict]:
    """Two dict batches of 4 documents (20 and 24 positions) whose attention masks keep only
    their first 2-4 tokens: most positions are padding (seeded)."""
    g = torch.Generator().manual_seed(5)
    batches = []
    for n in (20, 24):
        mask = torch.zeros(4, n, dtype=torch.long)
        for r in range(4):
            mask[r, :int(torch.randint(2, 5, (1,), generator=g))] = 1
        batches.append({"input_ids": torch.randint(0, 100, (4, n), generator=g),
                        "attention_mask": mask})
    return batches
