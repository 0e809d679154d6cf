"""Literal references that tests (and benchmarks) hold the fast forms to: the peers' loops
as written, slow on purpose."""

from collections import Counter

import numpy as np


def tensorrt_entropy_loop(hist, num_bits=8, start_bin=128, stride=1):
    """TensorRT's ``_compute_amax_entropy`` steps as written: a Python loop over thresholds.

    The slow, literal reference that tests and benchmarks hold the vectorized form to;
    returns every candidate's divergence and the chosen threshold bin (numpy in, numpy out).
    """
    bins = hist.astype(np.float64).copy()
    bins[0] = bins[1]
    nbins = 1 << (num_bits - 1)
    divergences = []
    for i in range(start_bin, len(bins) + 1, stride):
        new_density_counts = np.zeros(nbins, dtype=np.float64)
        space = np.linspace(0, i, num=nbins + 1)
        digitized_space = np.digitize(range(i), space) - 1
        digitized_space[bins[:i] == 0] = -1
        for idx, digitized in enumerate(digitized_space):
            if digitized != -1:
                new_density_counts[digitized] += bins[idx]
        counter = Counter(digitized_space)
        for key, val in counter.items():
            if key != -1:
                new_density_counts[key] = new_density_counts[key] / val
        new_density = np.zeros(i, dtype=np.float64)
        for idx, digitized in enumerate(digitized_space):
            if digitized != -1:
                new_density[idx] = new_density_counts[digitized]
        reference_density = np.array(bins[:len(digitized_space)])
        reference_density[-1] += np.sum(bins[i:])
        p = reference_density / reference_density.sum()
        q = new_density / new_density.sum()
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(p > 0, np.where(q > 0, p * np.log(p / q), np.inf), 0.0)
        divergences.append(terms.sum())
    divergences = np.array(divergences)
    last_argmin = len(divergences) - 1 - np.argmin(divergences[::-1])
    return divergences, last_argmin * stride + start_bin
