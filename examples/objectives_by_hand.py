"""The objective functions on hand-made numbers: what each public function returns.

python examples/objectives_by_hand.py
"""

from __future__ import annotations

import torch

from miniverl.objectives import generalized_jsd, grpo_advantages, kl_penalty, pg_k1_loss, topk_generalized_jsd


def main() -> None:
    teacher = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])  # [B=1, T=1, V=4]
    student = torch.tensor([[[0.0, 1.0, 0.5, 0.0]]])
    for beta in (0.0, 0.5, 1.0):
        print(f"generalized JSD, beta={beta}: {generalized_jsd(student, teacher, beta).item():.4f} nats")
    top = torch.log_softmax(teacher, -1).topk(2, dim=-1)
    print(f"top-2 support + tail, beta=1: {topk_generalized_jsd(student, top.values, top.indices, 1.0).item():.4f}")

    logprobs = torch.tensor([[-0.5, -1.0, -0.2]], requires_grad=True)  # student log q of 3 sampled tokens
    teacher_lp = torch.tensor([[-0.4, -2.0, -0.1]])
    loss, _ = pg_k1_loss(logprobs, logprobs.detach(), teacher_lp, torch.ones(1, 3))
    loss.backward()
    print(f"PG-k1 loss {loss.item():.4f}, gradient {logprobs.grad.tolist()} (= -(teacher - old) / tokens)")

    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    for kind in ("k1", "k2", "k3"):
        print(f"kl_penalty {kind}: {kl_penalty(lp, ref, kind).tolist()}")
    print("GRPO:", grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5]), ["a", "a", "b", "b", "c"]).tolist())


if __name__ == "__main__":
    main()
