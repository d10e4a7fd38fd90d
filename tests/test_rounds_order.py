"""Which round aggregate counts (protocols.rounds.candidate_order): no key to grind."""
from __future__ import annotations

import random

from protocols.rounds import candidate_order, inputs_digest, is_final

IDS = [f"{i:064x}" for i in range(1, 6)]


def test_final_and_larger_input_sets_come_first_whoever_signed() -> None:
    lone = ([IDS[4]], "00" * 32)  # the smallest entry id (the old rule's signer grinding, in spirit)
    two = (IDS[:2], "ff" * 32)
    three = (IDS[:3], "ee" * 32)
    order = candidate_order([lone, two, three], members=5)
    assert order == [2, 1, 0]  # 3 of 5 is final; then 2 inputs; the lone one last
    assert not is_final(1, 3) and is_final(2, 3) and not is_final(2, 4) and is_final(1, 1)


def test_ties_go_by_the_hash_of_the_inputs_then_entry_id() -> None:
    a, b = IDS[:2], [IDS[0], IDS[2]]
    first = min((a, b), key=inputs_digest)
    cands = [(b, "01" * 32), (a, "02" * 32)]
    assert cands[candidate_order(cands, members=3)[0]][0] == first
    same = [(a, "0f" * 32), (a, "0e" * 32)]  # same inputs: same global; the entry id only orders them
    assert candidate_order(same, members=3) == [1, 0]
    shuffled = list(cands)
    random.Random(0).shuffle(shuffled)
    assert shuffled[candidate_order(shuffled, members=3)[0]][0] == first  # independent of listing order
