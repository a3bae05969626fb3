"""Workloads the validation sends to real clusters and to the simulator alike."""

from __future__ import annotations

from sim.workload import Conversations, Sequential, SimRequest


def test_each_turn_sends_the_conversation_so_far_and_a_new_message():
    chat = Conversations(num_turns=3, first_tokens=(10, 10), user_tokens=(4, 4), output_tokens=2)
    (turns,) = chat.draw(1, seed=5)
    assert [t.request_id for t in turns] == ["c0000-t0", "c0000-t1", "c0000-t2"]
    assert [t.num_prompt_tokens for t in turns] == [10, 16, 22]  # + 2 reply + 4 message
    assert turns[1].prompt_token_ids[:10] == turns[0].prompt_token_ids
    assert turns[2].prompt_token_ids[:16] == turns[1].prompt_token_ids
    assert [t.max_tokens for t in turns] == [2, 2, 2]
    assert chat.draw(1, seed=5) == [turns]
    assert chat.draw(1, seed=6) != [turns]


def test_a_user_pauses_before_each_turn_without_changing_the_prompts():
    chat = Conversations(num_turns=3, first_tokens=(10, 10), user_tokens=(4, 4), output_tokens=2)
    (turns,) = chat.draw(1, seed=5)
    pauses = [t.think_s for t in turns]
    assert all(0.0 <= p <= 1.0 for p in pauses) and len(set(pauses)) == 3
    (unhurried,) = Conversations(num_turns=3, first_tokens=(10, 10), user_tokens=(4, 4),
                                 output_tokens=2, think_s=(2.0, 2.0)).draw(1, seed=5)  # fmt: skip
    assert [t.think_s for t in unhurried] == [2.0, 2.0, 2.0]
    assert [t.prompt_token_ids for t in unhurried] == [t.prompt_token_ids for t in turns]


def test_a_client_sends_one_conversations_turns_in_order_then_takes_the_next():
    def conversation(name: str) -> list[SimRequest]:
        return [SimRequest(f"{name}{t}", [t], 1) for t in range(2)]

    source = Sequential([conversation("a"), conversation("b"), conversation("c")])
    sent = [(c, source.next(c)) for c in (0, 1, 0, 0, 1, 0)]
    assert [(c, r and (r.request_id, r.client)) for c, r in sent] == [
        (0, ("a0", 0)), (1, ("b0", 1)), (0, ("a1", 0)), (0, ("c0", 0)), (1, ("b1", 1)),
        (0, ("c1", 0)),
    ]  # fmt: skip
    assert source.next(0) is None and source.next(1) is None
