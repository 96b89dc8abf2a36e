"""A fresh model's token embedding drawn from its corpus (train.embedding_init: corpus).

The embedding's rows are the tokens' coordinates in the leading singular directions of the corpus's positive
pointwise mutual information between neighbouring tokens (PPMI: how much more often two tokens sit side by side
than chance would put them), scaled to the init's standard deviation. Tokens that keep the same company start near
each other instead of at random. With the output tied to the embedding (model.tie_embeddings), a fresh model's
logits are dot products of its embedding rows, so it also starts out predicting a token's usual neighbours.
Through the 2-minute plans it measured 0.002-0.021 bits/byte better held out on three corpora, at every seed
(benchmarks/README.md, "An embedding drawn from the corpus").

Only a fresh model's embedding: a warm start (train.init_from) keeps its parent's. The rest of the init is
untouched and the global random stream is left where the model's init left it, so the batches and every other
weight are those of an ordinary run of the same seed.
"""

import warnings

import numpy as np
import torch

# Tokens of the training split that the statistics are counted on, from its start: a few million pairs pin the
# leading directions of a vocabulary of thousands; a corpus of billions of tokens need not be read for an init.
MAX_TOKENS = 1 << 24
POWER_ITERATIONS = 4  # torch.svd_lowrank's: with twice the rank sampled, 0.2% from the exact factors (V 960)


def square(index: torch.Tensor, values: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.sparse_coo_tensor(index, values, (vocab_size, vocab_size), check_invariants=True).coalesce()


def neighbour_ppmi(tokens, vocab_size: int) -> torch.Tensor:
    """The symmetric PPMI of adjacent tokens in `tokens` (the first MAX_TOKENS), as a sparse float64 matrix in
    compressed rows: log(c(a, b) · total / (c(a) · c(b))) where positive, with c counting a pair in either order."""
    ids = np.asarray(tokens[:MAX_TOKENS], dtype=np.int64)
    pairs, counts = np.unique(ids[:-1] * vocab_size + ids[1:], return_counts=True)
    first, second = pairs // vocab_size, pairs % vocab_size
    index = torch.from_numpy(np.stack([np.concatenate([first, second]), np.concatenate([second, first])]))
    cooccur = square(index, torch.from_numpy(np.concatenate([counts, counts]).astype(np.float64)), vocab_size)
    a, b = cooccur.indices()
    alone = torch.zeros(vocab_size, dtype=torch.float64).index_add_(0, a, cooccur.values())
    pmi = torch.log(cooccur.values() * cooccur.values().sum() / (alone[a] * alone[b]))
    # Compressed rows: torch.svd_lowrank's products took 1.1 s with them, 5.9 s with the same matrix as
    # coordinates (WikiText-2's 1408 tokens, 158k pairs, 2 cores). Torch calls their layout beta: not news for a log.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return square(cooccur.indices(), pmi.clamp(min=0), vocab_size).to_sparse_csr()


def corpus_embedding(tokens, vocab_size: int, dim: int, std: float, seed: int) -> torch.Tensor:
    """A (vocab_size, dim) float32 embedding: U·√S of the PPMI's leading `dim` singular triples, scaled to `std`.
    Where the vocabulary allows fewer directions than `dim`, the remaining columns are normal draws of `std`.
    The randomised SVD and those draws use their own generator seeded by `seed`: the global stream is untouched."""
    ppmi = neighbour_ppmi(tokens, vocab_size)
    rank = min(dim, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        u, s, _ = torch.svd_lowrank(ppmi, q=min(2 * rank, vocab_size), niter=POWER_ITERATIONS)
        spread = u[:, :rank] * s[:rank].sqrt()
        if not spread.abs().sum():
            raise ValueError("train.embedding_init corpus: the training split has no two neighbouring tokens")
        spread = spread / spread.std() * std
        rest = torch.randn(vocab_size, dim - rank, dtype=torch.float64) * std
    return torch.cat([spread, rest], dim=1).float()


def init_from_corpus(model, tokens, seed: int) -> None:
    """Set a fresh model's token embedding (and so a tied output) from the corpus: corpus_embedding at the
    model's init_std."""
    weight = model.embed.weight
    drawn = corpus_embedding(tokens, weight.shape[0], weight.shape[1], model.cfg.init_std, seed)
    with torch.no_grad():
        weight.copy_(drawn.to(weight.dtype))
