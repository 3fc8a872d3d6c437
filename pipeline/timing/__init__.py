"""The time stage's library: what a decoding step costs on this machine.

* `step_cost`: the measured step-cost model (draft by depth and width, verify by new rows and
  context, a fixed part), every figure a ratio to a phase probe timed beside it;
* `checks`: timed decodes of candidate trees that check the model, pruning by modeled cost,
  end-to-end tokens per second;
* `curves`: forward latency against new rows and context (one model or several interleaved);
* `dtype`: the decode dtype of this machine, measured (`dtype: auto`; the dtype stage);
* `batch`: the batch-size axis of the step-cost model;
* `measure`: the time stage's measurement of this machine and its candidate trees.
"""
