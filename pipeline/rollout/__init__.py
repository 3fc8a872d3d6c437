"""The rollout library (stages rollout, merge and scores): continuations of the calibration prompts
and their rank paths (`record`), shards merged in calibration order (`merge`), and the heads'
scores on EntMTP-dyn's super-trees (`scores`).

Greedy acceptance is a rank path (see `pipeline.replay`): the decoded text does not depend on the
tree, so one AR continuation y per prompt, one teacher-forced pass of the base model over
prompt + y, and the heads run along y give, for every step index i, the rank path
R[i, d-1] = rank of y_{i+1+d} in head d's distribution (capped at K). Every tree, policy and
oracle is then replayed from these arrays without running the model again."""
