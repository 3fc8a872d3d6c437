"""The shared simulator: exact replay of tree decoding from rank paths, used by grow, the time stage,
policy fitting, the bank, evaluate and the studies. `accept` (accepted lengths, walks, tokens per
step of one tree), `policy` (per-step policies over a bank, batched replays), `oracle` (the best
schedule in hindsight), `dynamic` (EntMTP-dyn's per-step subsets of a super-tree).

Under greedy verification the decoded text is the AR continuation y_1..y_T whatever the tree, so
a rollout's rank paths R [T, D] determine everything:

* accepted length of a tree at step index i = longest prefix of R[i] that is a node of the tree;
* a decode visits i_0 = 0, i_{s+1} = i_s + a(i_s) + 1;
* a per-step policy over a bank of trees, and the best schedule in hindsight (the oracle), are
  replays of the same arrays.

Counting convention (the same as a real decoder with max_new_tokens = T): the prefill emits y_1;
before the step at i the tokens y_1..y_{i+1} are known, and the step emits y_{i+2}..y_{i+a+2},
i.e. min(a + 1, T - 1 - i) tokens (only the very last step can be clipped: its bonus token would
be y_{T+1}). Steps run while a token is left, i.e. while i < T - 1. So the steps of one prompt
emit T - 1 tokens in all, and

    tokens per step = (T - 1) / steps        (the prefill token y_1 is not counted)

pooled over prompts as sum(T - 1) / sum(steps). Tokens per second = the same tokens / the sum of
the chosen trees' step costs (prefill excluded): a ratio between policies over one bank.

A rollout is a dict of arrays over step indices i = 0..T-1: `rank_paths` int [T, D] (ranks
capped at K = `rank_cap`: K means "not in the top K" or "beyond the end"), and for policies that
read a signal `p0` [T], `head_top1` [T, D], `entropy` [T]; optionally `rank_cap` (int; else it is
read off the data: the last row is all K) and `greedy_top1` [T, D]. Head-aware signals read
`greedy_top1` when present (the heads' top-1 probabilities along their *own* greedy chain: what a
decoder sees before verifying) and `head_top1` otherwise."""
