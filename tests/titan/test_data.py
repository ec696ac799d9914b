"""The indexable data layer: microbatch ids map to fixed, disjoint tokens; loader state."""

import numpy as np
import torch

from recover_hsdp.titan.data import MicrobatchDataLoader, PackedSequences, microbatch_sequence_ids


def _loader(replica=1, replicas=3, shard=0, ranks=2, lbs=2, g=2):
    tokens = np.arange(10_000, dtype=np.int32)
    return MicrobatchDataLoader(PackedSequences(tokens, seq_len=8, seed=0), replica=replica,
                                replicas=replicas, fsdp_rank=shard, fsdp_degree=ranks,
                                local_batch_size=lbs, microbatches_per_replica=g)


def test_sequences_are_shifted_windows_and_fixed():
    seqs = PackedSequences(np.arange(1000, dtype=np.int32), seq_len=8, seed=3)
    inputs, labels = seqs[5]
    torch.testing.assert_close(labels[:-1], inputs[1:])
    torch.testing.assert_close(seqs[5][0], PackedSequences(np.arange(1000, dtype=np.int32),
                                                           seq_len=8, seed=3)[5][0])
    assert not torch.equal(seqs[5][0], PackedSequences(np.arange(1000, dtype=np.int32),
                                                       seq_len=8, seed=4)[5][0])


def test_microbatch_sequence_ids_partition_the_stream():
    seen = []
    for microbatch in range(6):
        for shard in range(3):
            seen += list(microbatch_sequence_ids(microbatch, shard, 3, 2))
    assert seen == list(range(36))                     # disjoint, contiguous, no gaps


def test_failure_free_iteration_matches_the_stock_mapping():
    loader = _loader(replica=1, replicas=3, g=2)       # B = 6
    ids = [loader.failure_free_id(p) for p in range(6)]
    assert ids == [2, 3, 8, 9, 14, 15]                 # t*B + r*G + g
    first = next(iter(loader))
    torch.testing.assert_close(first[1], loader.batch(2)[1])


def test_state_is_in_whole_steps_so_a_resume_with_another_g_keeps_the_position():
    loader = _loader(g=2)
    iterator = iter(loader)
    for _ in range(4):                                 # two steps of G = 2
        next(iterator)
    state = loader.state_dict()
    resumed = _loader(replica=0, replicas=2, g=3)      # fewer replicas, same global batch
    resumed.load_state_dict(state)
    assert resumed.consumed == 2 * 3                   # step 2 starts at 2 * B
    assert resumed.failure_free_id(resumed.consumed) == 2 * 6
