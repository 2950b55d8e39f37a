"""The reward the exported run hands to verl (reward.custom_reward_function): miniVERL's exact match.

verl 0.9 calls `compute_score(data_source, solution_str, ground_truth, extra_info)` with the response
decoded without special tokens. This file is copied into every export and imports nothing from miniVERL.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """1.0 when the decoded response equals the ground-truth answer exactly, else 0.0."""
    return 1.0 if solution_str == ground_truth else 0.0
