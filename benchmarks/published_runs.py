"""Published end-to-end training runs against autopar's predicted throughput.

    python benchmarks/published_runs.py            # every row
    python benchmarks/published_runs.py --rows 0,3 # some rows

Every row is a training run a publication measured: the model written as that run wrote it
(GPT with materialised attention scores for Megatron-LM-style runs, Llama with fused
attention), planned on DGX nodes with the published tensor / pipeline / data degrees,
global batch, micro-batch, sequence, precision and recomputation pinned. autopar's
predicted step time becomes TFLOP/s per GPU by the publication's own FLOP count (the
Megatron-LM formula, Narayanan et al. 2021 eq. 3, ``96 B s l h^2 (1 + s/6h + V/16lh)``
with full recomputation, ``72 ...`` without), so predicted and published are counted alike.

HELD OUT rows (``held=True`` below: GPT 3.6B, 18.4B, 76.1B, 310.1B, 1008B, BLOOM 176B,
Llama 3 70B, Llama 3 8B on 8 H100, Llama 3 405B on 16,384 GPUs) were not looked at while
choosing any constant of the GPU cost model (``cost_models/gpus.py``, ``compute.py``,
``comm.py``, ``step.py``), with two exceptions, said here so the held-out mean can be
weighed: GPT 3.6B, which a first run printed (+12%) before the optimizer step, host
constant and cuBLAS tile choice were added (none of those was chosen on it); and Llama 3 8B
on 8 H100, whose error (+29%) was known when H100's fused-attention efficiency was changed
from FlashAttention-3's to FlashAttention-2's (``gpus.py``: torch's SDPA runs FA2 unless FA3
is activated; the figure is Dao 2023's, not chosen on the row). Dropout's one-byte mask
(``compute.py``: the bytes native_dropout moves; no constant) was added with every row's
error in view. No constant is fitted to any row (each cites a component-level measurement).
Also added with every row's error in view (2026-11-22), each a fact of how the run ran, not
a constant: no overlap of the gradient reduction where the code did not overlap it, the
torchtitan rows' selective recomputation, Llama 3's interleaved schedule and BLOOM's
network (below); and (2026-11-23), with row 14's error in view, that row's peak compute as
its publication states it (between H100 SXM's and NVL's: ``TORCHTITAN_H100_PEAK``).
Then (2026-11-23, session 13), with every row's error in view (rows 13 and 14 are held
out), two facts of how the torchtitan rows ran, read from their code, no constant added:
the model captured in bf16 as FSDP2 computes it and priced in its own dtypes (:func:`build`:
RMSNorm's fp32 statistics and the loss's fp32 logits had been priced at 16 bits), and the
copy-out after each ZeRO-3 gather on the compute stream (``CostModel._edge_steps``: FSDP2's
``wait_for_unshard`` runs ``foreach_all_gather_copy_out`` on the current stream; torch at
1963fc8, the benchmarks' commit; autopar's own ``ParamBucket._unflatten`` copies alike),
priced at the device's HBM bandwidth. Rows 12/13/14: +17.2/+13.4/+40.9% -> +12.2/+9.6/+31.4%.
And the dtype each run reduced its gradients in (``grad_reduce``, below), now that the cost
model prices the reduction in the runtime's dtype (fp32 under mixed precision unless
pinned; it had priced every reduction at 16 bits): BLOOM +18.6 -> +16.9%, Llama 3 405B
-1.7/-6.9 -> -2.7/-8.7%; the 16-bit rows did not move.
And torchtitan's optimizer as it ran: AdamW unfused (``foreach``; ``--optimizer.fused`` is
off by default at 9dec370), 80 bytes a parameter against the fused 28
(``cost_models.step.OPTIMIZER_BYTES_PER_PARAM``, derived from torch's
``_multi_tensor_adam``): rows 12/13/14 +12.2/+9.6/+31.4 -> +12.1/+9.4/+30.3%.

Gradient reduction dtype (``grad_reduce``), as each code base ran it: Megatron-LM (2021)
reduced fp16 gradients (``--accumulate-allreduce-grads-in-fp32`` is a store_true flag, off
by default, at 5c8238c of 2021-07; its LocalDDP keeps grad buffers in the parameters'
dtype otherwise), and DeepSpeed's fp16 engine (MT-NLG) too (``fp32_allreduce`` defaults to
False): those rows pin ``grad_reduce="bf16"`` (16 bits). BLOOM's bf16 training used
DeepSpeed's BF16_Optimizer (DeepSpeed issue #2352: "We have proven with the BLOOM training
that BF16 ... similar to the recently added BF16Optimizer"), whose
``get_grads_for_reduction`` hands over its fp32 gradient buffers; torchtitan reduces in
fp32 (``--training.mixed_precision_reduce`` defaults to float32); Llama 3 reduce-scatters
gradients in FP32 (Dubey et al. 2024, Sec. 3.3.2, numerical stability): fp32, the default.

How each run is pinned beyond its degrees: unpipelined rows with several micro-batches per
data-parallel rank accumulate gradients over the published micro-batch
(``micro_batch_size = micro x data``); pipelined rows run 1F1B over micro-batches of
``micro`` samples per data-parallel rank. BLOOM ran Megatron-DeepSpeed with ZeRO stage 1
(``zero=1``) on Jean Zay's nodes: 8 A100-80GB and four 100 Gb/s Omni-Path links each (Le
Scao et al. 2022, Sec. 3.4.1), a quarter of a DGX A100's 8 x 200 Gb/s (``nic_gbps``, at
InfiniBand's NCCL efficiency); its ALiBi bias sits in the scores' GEMM (``baddbmm``), so the learned position
embedding written here costs no extra pass over the scores. Llama 3 405B ran FSDP sharding
optimizer state and gradients but not resharding parameters after forward (Dubey et al.
2024, Sec. 3.3.2): ZeRO-2 (``zero=2``), over Megatron-LM's interleaved schedule (same
section; the number of virtual stages is not published: the solver picks it). The
torchtitan rows shard with FSDP2 (``zero=3``) and recompute selectively
(``selective_ac``: torchtitan's ``selective_ac_option=op`` policy, :func:`selective_ac_nodes`,
priced op by op from the plan's own prices and added to the step).

Overlap of the gradient reduction as each code base ran it (``overlap``): Megatron-LM
(2021)'s default ``--DDP-impl local`` all-reduced the gradient buffer after the whole
backward (``train_step``: ``model.allreduce_gradients()`` once ``forward_backward`` has
returned), and DeepSpeed's pipeline engine reduces after the last micro-batch's backward
(its ``TrainSchedule`` issues ``ReduceGrads`` after the final ``BackwardPass``): those rows
(0-11) add back what the estimate hides (its ``overlapped`` row). FSDP (torchtitan, Llama 3)
overlaps: the estimate's rule stands.

Not modelled, and why a row may differ:

- Megatron-LM (2021) fused scale-mask-softmax into one kernel (here: ``masked_fill`` and
  ``softmax``, each a memory-bound pass over b x heads x s^2) and bias-dropout-add (here:
  dropout, then add); its bias-GeLU fusion costs what the GEMM-epilogue bias and one GeLU
  pass cost here. Narayanan et al. 2021 Sec. 5.1 used the interleaved schedule with the
  scatter/gather optimisation; the rows pin plain 1F1B (the paper gives no chunk count per
  row) and every tensor-parallel rank sends the whole boundary activation.
- Overlap (``cost_models/step.py``, stated, not fitted): the data-parallel gradient
  reduction hides behind backward except its last 25 MiB bucket, ZeRO-3's gathers and
  reduce-scatters behind forward and backward except the first block's; a pipeline
  rank's once-per-step reduction behind its stages' last backward only (rows 12-16).
- torchtitan's selective recomputation is not something autopar plans (only whole layers):
  the rows are planned with no layer recomputed (``recompute="none"``; memory is not checked
  on them, since the policy's savings are not modelled) and the policy's forward seconds are
  added. Until 2026-11-23 the solver recomputed whole layers on top of it where memory bound:
  row 14 recomputed all 32 layers, then, once it chose the fewest that fit, 14; that double
  count hid part of row 14's gap (+17.7%, then +33.9%, +50.0% without it). Row 14's GPUs
  ran under a 500 W limit at a peak its publication puts between H100 SXM's and NVL's
  (``TORCHTITAN_H100_PEAK``, the midpoint: +40.9% where the SXM datasheet gave +50.0%); the
  Llama 3 405B rows ran at 700 W (Dubey et al. 2024, Sec. 3.3.1). The FSDP rows were 13-18% fast
  (2026-11-23): their gathers and reduce-scatters hide behind compute by the rule (0.35 s
  of communication a step against 2.1 s of compute for 8B on 64 A100s). Of what FSDP2 and
  torchtitan's eager code spend beyond that, two are now priced (session 13, above): the
  bf16 capture's own fp32 tensors (row 14: 2.02 -> 2.14 s a step) and the gathers'
  copy-out (30 ms a step on 8B, 0.46 s on 70B, whose full recomputation gathers a third
  time as every ZeRO-3 gather is priced here; FSDP2 gathers twice). Not priced: the
  reduce-scatter's ``_chunk_cat`` copy-in into its fp32 buffer, on the reduce-scatter
  stream beside backward's kernels (contention, not a term of its own); unfused eager
  elementwise ops are priced one kernel each already.
- MT-NLG 530B (DeepSpeed's pipeline engine) published 126 TFLOP/s where Megatron-LM's own
  530B run on the same machine published 163; the model prices both alike (pipeline
  bubble 12.4% against 10.8%), so it over-predicts MT-NLG: what DeepSpeed's engine spent
  beyond Megatron-LM's (blocking point-to-point, its schedule) has no component source here.
- The Llama 3 405B rows. Found and fixed on the way (2026-11-22): every Llama layer's
  residual was priced as crossing every later pipeline cut (a ``.to()``'s
  ``aten._assert_tensor_metadata`` reader was placed at the graph's end; -72% before), the
  rotary tables' gradient, which does not exist, as an all-reduce over the data axis per
  micro-batch (0.8 s), and a value several readers convert alike was converted (and
  priced) once per reader, where Megatron-style code gathers the normed, sequence-sharded
  hidden state once for q, k and v and once for w1 and w3 (tensor-parallel collectives
  3.46 -> 2.16 s; ``PriceTable.shared``, ``passes/insert_collectives``); activations count
  what autograd saves (``autopar/analysis/saved.py``: 0.94 GiB a layer a micro-batch, not
  1.58). Then (2026-11-23) the solver recomputed every layer (2.7 s of a 15.3 s step) where
  the plan then used 17 GiB of 80: it now recomputes, per pipeline rank, only the fewest
  layers that fit (``solver/partial_recompute.py``, Megatron-LM's
  ``--recompute-num-layers``; 32 of 126 on 8,192 GPUs, 34 on 16,384), and chooses the
  virtual-stage count on cut points priced for the most stages it tries
  (``pipeline_search.most_stages``; priced for 4 per rank, 8 per rank had only layer
  boundaries to cut at) with that recomputation in view. Row 15 went 15.30 -> 12.39 s,
  row 16 8.71 -> 6.89 s. Llama 3 trained without recomputation (Dubey et al. 2024, Sec.
  3.3.2); this Llama still keeps ``repeat_kv``'s copies and the gathered sequence-parallel
  inputs of its projections (Megatron-LM saves the sharded input and gathers it again in
  backward), part of why it still recomputes a quarter of its layers.
- Looked at on 2026-11-23 (session 12) and left: (a) the Megatron-LM-style rows' plans use
  sequence parallelism: on row 8 LayerNorm, dropout and the residual adds are sharded
  along the sequence on the tensor axis (``RS(0)S(1)``, reduce-scatter and all-gather)
  where Megatron-LM (2021) and Megatron-DeepSpeed ran them replicated after an
  all-reduce; the collectives move the same bytes, the replicated memory-bound passes
  would add a few percent on the tensor-8 rows (estimated, not measured), and no pin
  forbids sequence sharding yet. (b) DeepSpeed's pipeline engine (MT-NLG, BLOOM) sends the
  boundary activation partitioned over the tensor ranks (its ``is_pipe_partitioned``),
  so the point-to-point cost stands and MT-NLG's gap is not there. (c) Row 14's seconds:
  matmuls 60% (priced at ~700 TFLOP/s, 77% of ``TORCHTITAN_H100_PEAK``), attention 23%,
  memory-bound ops 17% (torch.compile's +16% there fits that share); a GEMM clock under
  the 500 W limit is the likely gap, but no bf16 GEMM measurement at 500 W was found (a
  power-capping study of the same 94 GB HBM2e H100, Ujeniya et al. 2026, arXiv
  2604.11391, measures DGEMM; its figures were not reachable here).
- The ILP's time limit (``--time-limit``) bounds the search: on a loaded machine a row may
  get a worse plan than the optimum and print a lower throughput.

MoE rows (2026-11-27, session 17; held out: no constant was chosen on them), tokens/s per
GPU as each publication reports it (GPU hours per trillion tokens, or the step time), the
model transformers' own class from its shipped config (``hf:deepseek-v3``,
``hf:qwen3-235b-a22b``: each MoE layer's experts one ``autopar::moe_experts`` op, priced by
``autopar/pricing/experts.py``), pinned with ``expert=`` (the stage's data ranks that
split the experts, as DeepSeek's EP and Megatron's folded EP run):

- 17 DeepSeek-V3 on 2,048 H800 (pipeline 16 x data 2 x expert 64, 120 micro-batches of 128
  sequences, 1F1B): predicted 889 against 1,543 tokens/s (-42.4%), 34.6 s a step against
  19.9 s (832, -46%, 36.9 s before the H100 attention constant was measured: 2026-11-27,
  session 18; which attention kernel DeepSeek ran is not stated, the measured cuDNN one is
  priced). Two facts of how it ran that autopar does not price: its GEMMs and their
  activations in FP8 (Sec. 3.3: fprop, dgrad and wgrad in FP8, about twice bf16's rate on
  Hopper; autopar's precisions were fp32, bf16 and fp16 then: priced since, below), and DualPipe (Sec. 3.2.1), which
  overlaps the all-to-all with compute and leaves a near-zero bubble, where 1F1B's is 22%
  of the predicted step. ZeRO-1 is not pinned (``zero=`` with ``expert=`` is refused yet).
- 18 Qwen3-235B-A22B under Megatron-Core, as run (TP 2, PP 32 with 3 virtual stages, EP 8,
  DP 4, the plain all-to-all dispatcher): refused by the stage DP: its memory rule gives
  each of a rank's v virtual stages 1/v of the device and counts the rank's in-flight
  micro-batches in each, so the last virtual stage (the 151,936-way head and loss over a
  4,096-token micro-batch) is charged ~22 micro-batches of logits where Megatron's
  interleaved schedule runs its backward at once (``solver/stage_dp.py``, the ``limit / v``
  constraint; a per-rank rule is the fix, not made here).
- 19 the same without virtual stages (1F1B, not as run): 1,522 against 1,354 tokens/s
  (+12.4%), 21.5 s a step against 24.2 s; before the H100 attention constant was measured
  (FlashAttention-2's figure), 1,345 (-0.7%), 24.4 s. Megatron-Core runs Transformer
  Engine's fused attention, cuDNN's kernel on Hopper, the kernel measured; what the row
  leaves out (its recomputed norms and activations, the dispatcher's permutations) is
  not priced. EP 8 folds over TP 2 x DP 4 in Megatron; here
  expert 4 is pinned beside tensor 2 and the plan splits the experts 4 ways and the tokens
  over the tensor axis (each tensor rank runs the experts for half the tokens).

Long-context rows (2026-11-28, session 19; held out), TFLOP/s per GPU, the sequence split
over a ``context`` axis as each run split it (``context=``; the graph in the causally
balanced order, ``autopar/capture/sequence_layout.py``; each row's ILP limited to 120 s:
CBC needed more than the default 30 on these):

- 20 Llama 3 405B's long-context stage (tensor 8 x context 16 x pipeline 16 x data 8 on
  16,384 H100, 131,072 tokens, K/V all-gathered): predicted 235 against 380 (-38.2%;
  session 20, after ZeRO-3's regathers were priced on every axis; 231, -39.2%, before),
  17.6 s a step (17.9 s before) (an earlier planning of the row, 17.6 s, printed a 31% bubble: 16
  micro-batches over 16 stages, interleaved; and activations filling the device, 78.7 GiB
  of 80). Before K/V were gathered ahead of
  their grouped-query copies (``autopar/capture/grouped_kv.py``) it was 140 (-63%).
- 21, 22 NeMo's Llama 2 7B at 128K (tensor 4 x context 4 x data 8) and 256K (tensor 4 x
  context 8 x data 8): 455 against 555 (-18.0%) and 467 against 549 (-15.0%) (-26.5% and -26.7% before the ring's backward overlapped its dK/dV transfers). The runs
  trained in FP8, which autopar does not price (bf16 here), and the page gives no batch
  (one sequence per data-parallel group, assumed).

``python benchmarks/published_runs.py --rows 20,21,22`` (274 s wall, 2026-11-28).

- 23-28 torchtitan's context-parallel sweeps (2026-11-28, session 20; held out; tokens/s per
  GPU; performance.md at d4c86e3, Tables 2 and 6, each table's CP 1 row beside its CP 2 and
  CP 4 rows): FSDP2 with full recomputation, K/V all-gathered, as torchtitan ran them at
  9dec370 (``TT_CP`` above RUNS), on row 14's H100s. The runs were compiled and trained
  their linears in Float8, the 405B ones with AsyncTP too: none of the three is priced
  (bf16, eager), so each error includes their gain. Llama 3.1 8B on 8 H100, one sequence
  per FSDP rank, 32,768 tokens a GPU in every row: CP 1 (32K) 4,144 against 3,890 (+6.5%),
  CP 2 (64K) 2,697 against 2,540 (+6.2%), CP 4 (128K) 1,592 against 1,071 (+48.6%). Llama
  3.1 405B on 512 H100 (TP 8, PP 8, 1F1B over 8 micro-batches of one sequence, ZeRO-2 as
  FSDP2 under PP ran): CP 1 66.3 against 76 (-12.8%), CP 2 53.0 against 47 (+12.9%), CP 4
  37.8 against 31 (+22.1%). The 8B steps: predicted 7.9, 12.2, 20.6 s, published 8.4, 12.9,
  30.6 s (59.8 s at CP 8): the predicted step grows as attention's work per GPU does (it
  doubles with each row), the published one by 17.7 s from CP 2 to CP 4 where the first two
  rows' difference (4.5 s, attention's doubling) predicts about 9. What torch's CP spends
  beyond that at 4 ranks is not priced and not identified here (its SDPA is run per K/V
  chunk and the chunks' outputs merged by log-sum-exp in fp32, ``_cp_options.
  convert_to_f32``; not measured). Rerun the same day (session 20) after two changes:
  ring attention's backward overlap (rows 21/22, ring: -26.5/-26.7% -> -18.0/-15.0%) and
  ZeRO-3 over the context axis too (torchtitan's FSDP over data and context ranks,
  ``dp_shard_cp``; it had held 2x / 4x the state on the CP 2 / CP 4 plans): 24 +6.1%, 25
  +48.5%, the others unchanged. With it Table 2's CP 8 row is added:
- 29 Llama 3.1 8B on 8 H100, FSDP 1 x CP 8, 262,144 tokens: 894.5 against 548 (+63.2%;
  step 36.6 s predicted, 59.8 s published): the trend of rows 23-25, the published step
  growing faster than attention's work. Table 6's CP 8 row (405B, 16) is not added: under
  PP torchtitan's FSDP does not reshard after forward (ZeRO-2 here, which shards over the
  data axis only; with one data rank the state would be whole).

``python benchmarks/published_runs.py --rows 23,24,25,26,27,28,29`` (37-71 s wall, 2026-11-28).

Last run (2026-11-23 17:20, session 13, PYTHONHASHSEED=0, 27 s wall), pred / publ error:
0 +9.5%, 1 +6.9%, 2 -1.7%, 3 -1.1%, 4 -5.7%, 5 +5.4%, 6 +2.1%, 7 +1.8%, 8 +2.9%, 9 -4.0%,
10 (MT-NLG) +30.7%, 11 (BLOOM) +16.9%, 12 +12.1%, 13 +9.4%, 14 +30.3%, 15 -2.7%, 16 -8.7%.
Mean |error| 8.9% over all 17 (tuned-on 8.4%, held out 9.4%): within 10%. Every row within
20%: not met, MT-NLG and row 14 are outside it. Moved this session: rows 12-14 (the bf16
capture, the ZeRO-3 copy-out, torchtitan's foreach AdamW), 11, 15, 16 (the gradient
reduction's dtype). Before: mean 10.0% (11 +18.6%, 12 +17.2%, 13 +13.4%, 14 +40.9%, 15
-1.7%, 16 -6.9%); before the session of 2026-11-23 (early): 15 -21.4%, 16 -25.8%, 14
+17.7%, mean 10.9%; before that of 2026-11-22: rows 0-14 11.9%, all 17 19.3%.

2026-11-29 (issue 39, item 2): the stage DP keeps at least 8 cut points a stage
(``pipeline_price.max_units``), so a 64-stage pipeline keeps every block boundary: row 9
(1008B, PP 64) -4.0% -> +6.3% (step 106.95 -> 96.57 s: its stages held 2.5 blocks where
the thinned cut points lacked a boundary); rows 4-8, 10, 11 unchanged (``--rows
4,5,6,7,8,9,10,11``, 17 s wall; mean |error| over them 8.7% -> 9.0%). Each pipeline boundary
is now priced on the link it crosses (NVLink inside a node): no row here has a boundary
inside a node (every pipeline's stages are 8 or more ranks apart), so none moves by it.

Published runs priced as they ran (2026-11-29, issues 39 and 44 item 5): every row that
trained its GEMMs in FP8 pins ``precision="fp8"`` (``Run.precision``, ``fp8_scaling``; the
linears torchao converts, head kept bf16: ``autopar.analysis.fp8_layers``; priced by
``autopar/pricing/fp8.py``: the fp8 peak, the casts, the amax gathers), DeepSeek-V3 pins
``schedule="dualpipev"``, and torchtitan's Float8 tables are rows (30-33, ``TT_FP8``).
``Run.lacks`` names what a run used that autopar still does not price; the table marks
every row beyond 20% (``!``) and prints it. ``--before`` prices each such row without
FP8 / DualPipeV too (bf16, 1F1B) and prints both. Before -> after (this run's --before):

- 17 DeepSeek-V3: FP8 with rowwise scaling, the closest autopar runs to its fine-grained
  1x128 activation tiles and 128x128 weight blocks (DeepSeek-AI 2024, Sec. 3.3.2), and
  DualPipeV, torch's V form of DualPipe (Sec. 3.2.1; DualPipe itself keeps two copies of
  the parameters, the V form one: ``autopar/schedule.py``); PP 16 and 120 micro-batches a
  step fit its needs (two stages a rank, m >= 2 x 16). -42.4% -> -41.8%: fp8 alone
  (1F1B) -40.0%, the 32 stages of two layers each take the bubble from 0.215 to 0.129 but
  double the point-to-point (0.32 -> 1.28 s a step: autopar runs DualPipeV's paired F and
  B one after the other, as torch 2.13 does without a custom ``OVERLAP_F_B``, so nothing
  hides it) and cut 61 layers into 30 stages of two and two end stages of embedding and
  head (4 layers a rank against 1F1B's 3.8). The gap is the experts: their op
  (``autopar::moe_experts``) is 58% of a micro-batch's forward (0.61 of 1.05 s, read from
  the plan's node prices) and autopar's fp8 recipe converts ``nn.Linear`` layers only, so
  the routed experts' GEMMs (~4 of its 10.5 ms a layer) stay bf16 where DeepSeek ran them
  in FP8, and their dispatch and combine (four all-to-alls a layer, ~3 ms of the forward's
  10.5) are exposed where DualPipe hides them behind the other micro-batch's compute
  (Sec. 3.2.1, Fig. 4); DeepSeek also dispatched in FP8 (Sec. 3.3.3). Estimated from those
  figures, not priced: the two would take about a quarter off the step (about -20% left).
  Since priced (2026-11-30, issue 44 item 4): autopar now runs each DualPipeV pair's two
  halves at once where a stage's experts dispatch by all-to-all (``runtime.overlap``) and
  prices each pair's all-to-alls as hidden behind the other half's compute
  (``pipeline_price.pair_hidden``): -41.3% -> -29.0% (33.90 -> 28.05 s a step).
  Since 2026-11-30 (session 32, ``autopar/ops/fp8_experts.py``, ``pricing/experts_fp8.py``)
  the experts' GEMMs run and are priced in fp8 too (chosen by price; the casts fused, as
  the row prices them): -41.3% -> -37.3% (906.1 -> 968.2 tokens/s, 33.90 -> 31.73 s a
  step). With both: -25.6% (1,148.2 tokens/s, 26.76 s a step); left: the FP8 dispatch.
- 21, 22 NeMo's Llama 2 7B at 128K / 256K (Transformer Engine FP8, per-tensor delayed
  scaling: tensorwise, ``NEMO_FP8``): -18.0 / -15.0% -> -14.0 / -12.5%. At these lengths
  attention (bf16 in both) is most of the step; the linears' fp8 saves 0.12 s of 2.57 on
  128K, the casts taking ~0.08 s of the 0.2 their GEMMs give back. Transformer Engine's
  casts cost less than torchao's dynamic ones autopar prices (delayed scaling reads last
  steps' amax, so no amax pass: 3 bytes an element against 5; LayerNormLinear casts x
  once in the norm's kernel for q/k/v and for w1/w3): ~0.05 s here, left (a recipe autopar
  does not run).
- 23-29 torchtitan's CP sweeps (Float8 tensorwise as run; the CP 1 rows compiled too, as
  run: ``compile`` is refused beside ``context=``, so CP 2-8 are eager; "before" of a CP 1
  row is its compiled bf16 price): 8B CP 1 / 2 / 4 / 8 +8.5 / +6.1 / +48.5 / +63.2% ->
  +23.5 / +15.0 / +55.6 / +67.5%; 405B CP 1 / 2 / 4 -12.8 / +12.9 / +22.1% -> +10.5 /
  +36.4 / +39.2%. These rows were near by cancellation: Float8 unpriced on one side, torch
  CP's own cost (``TT_CP_COST``, not identified: the published step grows faster than
  attention's work, rows 23-25 above) on the other; pricing the first exposes the second.
  Row 23 joins row 14's gap (the torchtitan H100 rows' GEMM clock under 500 W).
- FP8's price against its measured gain, where a publication ran the same configuration
  in bf16 and Float8 (``benchmarks/ranking.py``): 8B on 8 / 128 H100 +28.0 / +28.6%
  measured, +22.3 / +22.6% priced; 70B TP 8 tensorwise +35.6%, +18.5%; 8B TP 8 +16.0%,
  +2.7%. The price falls short of the gain, it does not overshoot: the term is the casts,
  priced as torchao's eager dynamic cast (5 bytes, two kernels an element:
  ``cost_models/fp8.py``) on compiled rows too, where Inductor fuses the scaling into
  neighbouring kernels; changed below (2026-11-29, compiled casts).
- 30-33 torchtitan's Float8 tables (new rows, held out): 8B on 8 H100 +11.4% (bf16: -8.9%),
  on 128 +15.1% (-6.1%), 70B FSDP 32 x TP 8 +2.6% (-13.4%), 405B FSDP 8 x TP 8 x PP 8 1F1B
  +8.9% (-18.9%; AsyncTP not priced). The eager bf16 row of Table 1 (14) is +30.3%, its
  compiled one (``benchmarks/ranking.py``) +16.6%: the Float8 rows carry that gap.
- Not added: Llama 4's "390 TFLOPs/GPU" on 32K GPUs in FP8 (Meta, "The Llama 4 herd",
  2025-04-05 blog): neither the model it measured (Behemoth's shape is not published) nor
  its degrees, batch or sequence are stated, so it cannot be pinned.

Compiled casts and compiled pipelines (2026-11-29, issue 44 item 1 and 39): under
``compile=True`` the fp8 casts are priced at the traffic torchao's own roofline of compiled
float8 training counts (torchao 0.14.0 ``testing/training/roofline_utils.py``: the
activations' amax fused into their producer; tensorwise x and dy 4 bytes an element, W 8
over both passes, against eager's 5 and 10: ``cost_models/fp8.CAST_TRAFFIC``), and
``compile`` now reaches a pipeline's stages (``pipeline_search.INTRA_PINS`` dropped it: a
pipelined plan priced ``compile=True`` exactly as eager). Every FP8 row pins
``fp8_layers="all"``: the runs converted every linear but the output layer, not chosen by
price. Rows 23 / 26 / 30 / 31 / 32 / 33: +23.5 / +10.5 / +11.4 / +15.1 / +2.6 / +8.9% ->
+24.7 / +13.7 / +13.3 / +17.1 / +5.5 / +12.9% (``--rows 23,26,30,31,32,33``; 26 and 33,
the pipelined ones, by the compile fix, the others by the casts); the other rows are
neither compiled nor pipelined-compiled and do not move. The mean over 33 rows, the
records above with these six replaced: 16.6% -> 17.1%. The priced Float8 gain over
compiled bf16 (``benchmarks/ranking.py``, groups ``tt-h100-8b-8`` / ``-128``) 22.3 / 22.6%
-> 24.4 / 24.7%, measured 28.0 / 28.6%: nearer the gain, and every Float8 row further
above its published throughput, so the gap these rows carry is not the casts (row 14's
bf16 eager +30.3%, its compiled one +16.6%: the torchtitan H100s' clock under 500 W, not
measured). One ranking is lost: ``tt-atp-8b``'s rowwise Float8 under TP 8 ran slower than
bf16 and is now priced faster (Spearman over its goal rows 1.00 -> 0.50; docs/measured.md):
its cause, rowwise GEMM throughput under TP, is not priced. No constant was fitted to a row.
Regained (branch h-rank2): torchao runs rowwise's backward GEMMs as cuBLAS's tensorwise
GEMM and rescales their bf16 outputs in a kernel of its own (``cost_models/fp8.py``,
``RESCALE_TRAFFIC``): rowwise under TP 8 is priced slower than bf16 again (Spearman 1.00);
row 17 (rowwise) -41.8% -> -42.8%, the 33 rows' mean stays 17.1%.

Mean |error| over every row that plans (row 18 is refused, docstring above): 16.6% over
33 rows, 14.9% with the FP8 / DualPipeV rows priced in bf16 / 1F1B (``--before``); over
the rows 0-29 that predate this, 17.6% against 15.3%. Beyond 20%, each marked with what
it lacks: 10, 14, 17, 20, 23, 25, 27, 28, 29. Rows this change does not touch moved
since their last record by other work on main: 15 -2.7 -> +3.4%, 16 -8.7 -> +2.1%, 20 -38.2
-> -33.1%; the others as recorded.
The issue's goal (<= 10%) is not met, and pricing FP8 moved the mean away from it (the
rows it moves were off by terms it had hidden, above); no constant was fitted to a row.
``PYTHONHASHSEED=0 python benchmarks/published_runs.py --before`` (every row in one run,
3,066 s wall on the loaded 2-core machine, 2026-11-29; rows 23-33 priced again beside it,
the same figures; tuned-on 8.5% over 8 rows, held out 19.2% over 25).

Each publication's own FLOP count, each run's own program (2026-11-30, issue 39; no
constant added or changed):

- Llama 3's Table 4 counts attention over the whole square (``ATTENTION_FLOPS``): its
  TFLOP/s per GPU are its MFU, which it takes from Chowdhery et al. (PaLM, Appendix B:
  ``6N + 12LHQT`` a token), times the H100's 989; the rows had converted the predicted step
  with the causal half (``6 l s h``). Rows 15 / 16 / 20: +3.4 / +2.1 / -33.1% -> +7.5 /
  +6.2 / -6.2% (the 128k row's attention is 40% of the causal count; the step is unchanged,
  16.30 s). NeMo's pages count so too (``NEMO_FLOPS``: the long-sequence page does not say,
  its team's summary page of 24.07 gives tokens/s beside TFLOP/s and their ratio is the
  whole-square count to 0.1% on two Llamas): rows 21 / 22 -13.4 / -12.2% -> +49.1 / +61.4%
  (steps unchanged, 2.43 / 4.18 s; ``--rows 21,22``, 101 s wall). They were near because the
  count halved what the run spent on attention; counted as published, the price of their
  attention is the gap: autopar prices it as one fused attention at the cuDNN rate measured
  on torch 2.11 (0.68 / 0.59 of peak at length), where Transformer Engine 1.3-1.5 ran its
  ring's steps through cuDNN's fused kernel (it selects FusedAttention on sm90 under context
  parallelism, ``DotProductAttention.forward``) with fp32 corrections between them, in
  2024's cuDNN: not measured (``NEMO_CP_ATTENTION``, marked).
- torchtitan's CP rows (23-29 with ``context > 1``) gather the repeated K/V: torchtitan
  repeats K/V to every query head before SDPA (:class:`TitanAttention`) and torch's CP
  gathers SDPA's own inputs and passes their gradients in fp32, where autopar's capture had
  given the copies back to attention grouped (``capture/grouped_kv.py``) and so priced 1/4
  of the bytes on 8B and 1/16 on 405B under TP 8, whose CP ranks sit in different nodes
  (torchtitan's mesh puts ``cp`` outside ``tp``). Rows 24 / 25 / 27 / 28 / 29: +15.7 /
  +56.1 / +38.0 / +40.2 / +67.8% -> +13.9 / +52.0 / +24.0 / +15.3 / +62.3% (405B CP 4's
  step 94.25 -> 114.61 s against 132 s published). ``--rows 15,16,20,24,25,27,28,29``, 539 s
  wall on the loaded machine (load 13).
- Looked at, not changed: Float8 under FSDP all-gathers bf16 weights in these runs
  (``--float8.enable_fsdp_float8_all_gather`` is off by default at 9dec370 and the
  benchmark page names no flag): every fp8 row pins ``fp8_all_gather=False`` (autopar's
  default gathers a tensorwise fp8 linear's ZeRO-3 weight in fp8); torch's CP (``_templated_ring_attention`` of that time, read
  from a stored copy, not at 1963fc8 itself) issues its K/V all-gather before the first
  (local, causal) block and overlaps the ring's dK/dV sends with the next block,
  where autopar's ``"all-gather"`` form exposes both (it overcharges, the rows are fast:
  not the gap). The 8B rows' published step grows by 17.7 s from CP 2 to CP 4 and 29.2 s
  from CP 4 to CP 8 where the priced one grows by 8.8 and 16.7 s (attention's work per GPU
  doubling; from CP 1 to CP 2, 4.5 s published, 4.6 priced): torch CP's cost beyond that
  at 4 and 8 ranks stays unidentified (``TT_CP_COST``). Counted as published, the two
  ring implementations are off alike and more so with more ranks (torch's CP 4 / 8 +52.0 /
  +62.3%, Transformer Engine's +49.1 / +61.4%) while Llama 3's one attention call over
  gathered K/V is -6.2%: the common term is most likely a ring's per-step pieces and their
  fp32 merges, priced here as one fused attention. autopar measured its own pieces
  (``gpus._HOPPER_CONTEXT``), not torch's or TE's; a GPU session can time torch's
  ``_templated_ring_attention`` on one GPU under a fake process group at these shapes.

Mean |error| over the 33 rows: 17.1% -> 17.6% (before: ``python
benchmarks/published_runs.py``, every row, 953 s wall / 229 CPU s at load 13, 2026-11-30,
the records above; after: every row again, 788 s wall / 253 CPU s at load 13-16, tuned-on
9.0% over 8 rows, held out 20.4% over 25); 15.1% with the NeMo rows counted causally as
before. Beyond 20%, each marked: 10, 14, 17, 21, 22, 23, 25,
27, 29. The goal (<= 10%) is not met; the mean rose because two rows that were near by a
miscount are now compared as published.

Hopper's GEMMs at the rates the GPU check measured on the free plans' shapes (2026-12-02,
session 43: forward 0.75 of peak, not 0.79; backward 0.90 of the forward's rate;
``cost_models/gpus.py``). ``--rows 14,15,16,17,19,20`` before (a worktree of the commit
before) and after, side by side on the loaded machine: 14 +30.3 -> +22.2%, 15 -6.4 ->
-12.8%, 16 -7.1 -> -13.6%, 17 -6.8 -> -9.9%, 19 +23.2 -> +18.0%, 20 -14.1 -> -16.4%; mean
|error| over the six 14.7 -> 15.5%. The torchtitan-stack rows (and the ranking's H100
groups, ``benchmarks/ranking.py``) come nearer; the Llama 3 405B rows, run on Meta's own
stack at 700 W, and DeepSeek-V3's go further below: the measured rates are torch's
``F.linear`` on cuBLAS (torch 2.11), the kernels autopar's runtime runs, not necessarily
theirs. Row 21 after: +38.1% (the NeMo rows 21-33 were not priced again: row 21 alone took
907 s to plan under that load).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from autopar.pricing.costing import OVERLAPPED  # noqa: E402
from autopar.solver.driver import solve  # noqa: E402
from examples.base import Example, lm_loss  # noqa: E402
from autopar.cost_models.devices import Cluster  # noqa: E402
from autopar.cost_models.fp8 import fused_casts  # noqa: E402
from autopar.cost_models.gpus import _IB_EFF, DEVICES, NODES, Gbit  # noqa: E402
from autopar.cost_models.step import HOST_OVERHEAD_S, optimizer_step_time  # noqa: E402
from examples.llama import Llama, LlamaAttention, LlamaConfig, apply_rotary  # noqa: E402


# --- Models as the publications ran them -------------------------------------------------
class MegatronAttention(nn.Module):
    """Megatron-LM's self-attention (2021-22): fused QKV projection, scores materialised
    with ``baddbmm(alpha=1/sqrt(d))``, causal mask and softmax, attention dropout, then the
    context ``bmm``."""

    def __init__(self, h: int, heads: int, dropout: float):
        super().__init__()
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.heads, self.p = heads, dropout

    def forward(self, x):
        B, T, C = x.shape
        d = C // self.heads
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.heads, d).transpose(1, 2)
        k = k.view(B, T, self.heads, d).transpose(1, 2)
        v = v.view(B, T, self.heads, d).transpose(1, 2)
        # Megatron folds 1/sqrt(d) into the scores' GEMM (baddbmm alpha); scaling q costs
        # the same GEMM and an elementwise op over b s h, not over b heads s^2
        scores = torch.matmul(q * (1.0 / math.sqrt(d)), k.transpose(-2, -1))  # (B, H, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        probs = F.dropout(F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1),
                          self.p, self.training)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, C)
        return F.dropout(self.proj(y), self.p, self.training)


class MegatronBlock(nn.Module):
    def __init__(self, h: int, heads: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(h)
        self.attn = MegatronAttention(h, heads, dropout)
        self.ln_2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)
        self.p = dropout

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + F.dropout(self.fc2(F.gelu(self.fc(self.ln_2(x)))), self.p, self.training)


class MegatronGPT(nn.Module):
    """GPT as Megatron-LM trains it: learned positions, pre-LayerNorm blocks, GELU MLP of
    4h, output head tied to the word embedding."""

    def __init__(self, layers: int, h: int, heads: int, vocab: int, seq: int,
                 dropout: float = 0.1):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(seq, h)
        self.h = nn.ModuleList([MegatronBlock(h, heads, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(h)
        self.p = dropout

    def forward(self, tokens):
        T = tokens.shape[1]
        pos = torch.arange(T, device=tokens.device)
        x = F.dropout(self.wte(tokens) + self.wpe(pos), self.p, self.training)
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


class TitanAttention(LlamaAttention):
    """Llama attention as torchtitan writes it (``torchtitan/models/llama/model.py`` at
    9dec370, ``Attention.forward``): K and V repeated to every query head (``repeat_kv``, on
    the ``(batch, seq, heads, head_dim)`` layout) before they are transposed and handed to
    ``F.scaled_dot_product_attention``. Under torch's context parallelism it is the repeated
    K/V that the ranks gather (``_templated_ring_attention``: ``torch.cat([key.flatten(),
    value.flatten()])`` of SDPA's own inputs) and whose gradients travel in float32: query
    heads / K/V heads times the bytes of the grouped tensors (4x on Llama 3 8B, 16x on 405B
    under TP 8: 16 query heads a rank against one K/V head). autopar's capture gathers K/V
    before their copies where the graph lets it (``autopar.capture.grouped_kv``: the copies
    read as ``SDPA(q, repeat(k), repeat(v))``); here the transposes stand between, as in
    torchtitan's code, so the gathered K/V are the repeated ones, as run. The rotary product
    is ``examples.llama``'s (the same bytes as torchtitan's complex one: :func:`_build`)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        hd, n_rep = self.head_dim, self.n_head // self.n_kv_head
        q = self.wq(x).view(B, T, self.n_head, hd).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin).transpose(1, 2)
        # torchtitan's repeat_kv: x[:, :, :, None, :].expand(bs, slen, n_kv, n_rep, hd).reshape(...)
        k, v = (t[:, :, :, None, :].expand(B, T, self.n_kv_head, n_rep, hd)
                .reshape(B, T, self.n_head, hd).transpose(1, 2) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_head * hd))


def _example(model: nn.Module, batch: int, seq: int, vocab: int) -> Example:
    tokens = torch.zeros(batch, seq, dtype=torch.long)
    return Example(model, (tokens,), torch.zeros(batch, seq, dtype=torch.long), lm_loss)


# --- Runs --------------------------------------------------------------------------------
@dataclass
class Run:
    name: str
    source: str
    arch: str                   # "gpt" (Megatron GPT, unfused attention), "llama", or
                                # "hf:NAME" (a shipped transformers config, autopar.hf_models)
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    batch: int                  # global batch (sequences)
    gpus: int
    device: str                 # "a100" or "h100"
    tensor: int
    pipeline: int
    micro: int = 1              # micro-batch size
    recompute: bool = True      # full activation recomputation
    published_tflops: float = 0.0   # TFLOP/s per GPU as published
    held: bool = False          # held out from every decision about constants
    kv_heads: int = 0           # llama: grouped-query attention
    ffn: int = 0                # llama: SwiGLU inner size
    schedule: str = "1f1b"
    virtual: int = 1
    zero: int = 0
    published_tps: float = 0.0  # tokens/s per GPU as published (when that is the metric)
    extra: dict = field(default_factory=dict)
    overlap: bool = True        # the gradient reduction overlapped backward (see OVERLAP)
    nic_gbps: float = 0.0       # the nodes' network line rate (all NICs), when not a DGX's
    selective_ac: bool = False  # torchtitan's selective op recomputation (see selective_ac_s)
    torchtitan: bool = False    # written and run as torchtitan ran it (see build)
    grad_reduce: str = "fp32"   # the dtype gradients were reduced in ("bf16": 16 bits; docstring, "Gradient reduction dtype")
    expert: int = 1             # expert parallelism: experts split over this many of a stage's data ranks
    pin_more: dict = field(default_factory=dict)   # further pins (a run's own expert dispatch)
    context: int = 1            # context parallelism: the sequence split over this many ranks
    time_limit_s: float = 0.0   # the ILP's limit for this row, when the default is too short
    selective_nodes: object = None  # under selective_ac: cap -> the nodes recomputed (None: torchtitan's policy)
    stage_split: str = ""       # the stage_split= pin of a pipelined run ("": the stage DP's cuts)
    precision: str = "bf16"     # the GEMMs' precision as run ("fp8": precision="fp8", its linears)
    fp8_scaling: str = ""       # under fp8: the recipe's scaling as run ("tensorwise" / "rowwise")
    lacks: str = ""             # what the run used that autopar does not price (printed per row)
    attention_flops: str = "causal"  # llama: the publication's attention count ("full": PaLM's
                                     # 12 l s h a token, no causal saving; ``ATTENTION_FLOPS``)

    @property
    def data(self) -> int:
        """Data-parallel ranks beside the expert axis (whose ranks split the batch too) and
        the context axis (whose ranks split the sequence)."""
        return self.gpus // (self.tensor * self.pipeline * self.expert * self.context)

    def model_flops(self) -> float:
        """FLOPs per step by the publication's count (Narayanan et al. 2021, eq. 3; for
        Llama: 6 N D + attention, with the SwiGLU MLP, as the Llama 3 paper counts MFU)."""
        B, s, l, h, V = self.batch, self.seq, self.layers, self.hidden, self.vocab
        if self.arch == "gpt":
            f = 96 if self.recompute else 72
            return f * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
        # Llama: per token 6 * (params in matmuls) + attention's two matmuls (QK^T, PV: 4 s h
        # a token a layer forward, x3 with backward) over the causal half (6 l s h) or, where
        # the publication counts it so, the whole square (12 l s h: ``ATTENTION_FLOPS``)
        kvd = h // self.heads * self.kv_heads
        per_layer = h * h * 2 + 2 * h * kvd + 3 * h * self.ffn
        dense = l * per_layer + h * V
        attention = {"causal": 6, "full": 12}[self.attention_flops] * l * s * h
        return B * s * (6 * dense + attention)


# TFLOP/s per GPU as published. Megatron-LM 2021 = Narayanan et al., "Efficient
# Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC21, Table 1
# (weak scaling; sequence 2048, vocabulary 51,200, full recomputation, mixed precision,
# A100-80GB DGX nodes, micro-batch 1 in the pipelined rows).
# Korthikanti 2022 = "Reducing Activation Recomputation in Large Transformer Models",
# Table 5 (iteration time of the full-recomputation baseline, tensor parallel without
# sequence parallelism; A100-80GB); TFLOP/s per GPU derived from that iteration time with
# the same eq. 3 count.
# BLOOM = Le Scao et al. 2022 ("BLOOM: A 176B-Parameter Open-Access Multilingual LM",
# Sec. 3.4.2): 384 A100-80GB, TP 4, PP 12, DP 8, ~150 TFLOP/s per GPU.
# MT-NLG = Smith et al. 2022 ("Using DeepSpeed and Megatron to Train Megatron-Turing NLG
# 530B"), Table 1: 280 DGX-A100 nodes, TP 8, PP 35, batch 1920, 126 TFLOP/s per GPU.
# OPT = Zhang et al. 2022 ("OPT: Open Pre-trained Transformer LMs", Sec. 2.4): 992
# A100-80GB, Megatron TP 8 with FSDP, 147 TFLOP/s per GPU.
# torchtitan = PyTorch torchtitan docs/performance.md (Liang et al., "TorchTitan", 2024):
# Llama 3 8B and 70B with FSDP2 (ZeRO-3) on 64 A100-80GB, sequence 8192, local batch 1;
# tokens/s per GPU ("WPS"): 8B selective-op recomputation 2,973; 70B full recomputation 331.
# Llama 3 = Dubey et al. 2024 ("The Llama 3 Herd of Models"), Table 4: 405B on H100,
# sequence 8192, TP 8, PP 16: 8,192 GPUs 430 TFLOP/s, 16,384 GPUs 400 TFLOP/s per GPU;
# Sec. 3.3.2: FSDP shards optimizer state and gradients, parameters not resharded after
# forward (ZeRO-2).
# The torchtitan H100s' peak compute, as their publication states it (performance.md,
# footnote 2 of the 2024-12 benchmarks: "HBM2e-based SXM H100 with lower TDP, the actual
# peak TFLOPs number is between SXM and NVL, and we don't know its exact value"): the
# midpoint, per precision, of the H100 SXM datasheet (``gpus.H100_80GB``) and the H100 NVL
# datasheet (NVIDIA H100 NVL product brief: FP32 60, TF32 835, BF16/FP16 1,671 TFLOPS, the
# Tensor Core figures with sparsity, so 417.5 / 835.5 dense; FP8 3,341 with sparsity, 1,670.5
# dense). Row 14's error at either end: SXM +50.0%, NVL +31.5% (2026-11-23); the midpoint is
# not chosen on the row.
H100_NVL_PEAK = {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12, "fp8": 1670.5e12}
TORCHTITAN_H100_PEAK = {k: (v + H100_NVL_PEAK[k]) / 2 for k, v in DEVICES["h100"].peak_flops.items()}
# The fused attention of the 2024 H100 runs (torchtitan's Table 1, Llama 3): FlashAttention-2,
# torch's SDPA flash backend then, at "up to 335 TFLOPs/s" forward + backward on H100 (Dao
# 2023, Sec. 4.1, Fig. 7), 0.339 of 989, split in A100's forward:backward ratio: 0.375, 0.326
# (what ``gpus.py`` held until the GPU check measured torch 2.11's default there, cuDNN's
# kernel, at 0.58-0.65 / 0.50-0.52: 2026-11-27). The GPU check's FlashAttention-2 on one
# H100 measured 0.27-0.34 / 0.19-0.31 (benchmarks/results/gpu_check_nvidia-h100-80gb-hbm3.json).
FA2_H100 = {"attention_efficiency": (0.375, 0.326), "attention_half_seq": (0.0, 0.0)}
# DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437): 2,048 H800 (Sec. 3.1); pipeline 16,
# expert parallelism 64 over 8 nodes, ZeRO-1 data parallelism, no tensor parallelism
# (Sec. 3.2); sequence 4,096 and a batch ramped to 15,360 sequences (Sec. 4.2); "180K H800
# GPU hours" per trillion tokens (Sec. 1; Table 1: 2,664K GPU hours for 14.8T tokens):
# 1e12 / (180e3 * 3600) = 1,543 tokens/s per GPU.
DEEPSEEK_V3_TPS = 1e12 / (180e3 * 3600)
# Qwen3-235B-A22B under Megatron-Core (github.com/yanring/Megatron-MoE-ModelZoo,
# best_practice/Qwen3/readme.md at c1ad0b5, the "A2A" dispatcher row): 256 H100 (DGX-style,
# NVLink 4, 8 x 50 GB/s InfiniBand), bf16, sequence 4,096, TP 2, EP 8 (folded over TP x DP),
# PP 32 with 3 virtual stages, DP 4, micro-batch 1, global batch 2,048, recomputing norms
# and activations; 24.2 s a step: 2048 * 4096 / 24.2 / 256 = 1,354 tokens/s per GPU.
QWEN3_235B_TPS = 2048 * 4096 / 24.2 / 256
# Long context (issue 29). Llama 3 405B's long-context stage (Dubey et al. 2024, Table 4, third
# row): 16,384 H100, sequence 131,072, TP 8, CP 16, PP 16, DP 8, batch 16 sequences per DP
# group (16M tokens a step), 380 TFLOP/s per GPU; CP as an all-gather of K/V (Sec. 3.3.2:
# "all-gather based ... then compute attention output for the local Q tensor chunk"),
# ZeRO-2 as the 8k rows. NeMo's long-sequence sweep (NVIDIA NeMo
# docs/source/performance/performance_long_sequence.md at 0aa2671, "LLAMA2-7B (FP8)",
# DGX-H100, NeMo 24.03.01): Llama 2 7B with CP at 128K (128 GPUs, TP 4, PP 1, DP 8, CP 4,
# 555 TFLOP/s per GPU) and 256K (256 GPUs, TP 4, DP 8, CP 8, 549); it trained in FP8, which
# autopar does not price (bf16 here: the error includes FP8's GEMM gain), and the page gives
# no batch: one sequence per data-parallel group (micro-batch 1), full recomputation off.
NEMO_LONG = "NeMo performance_long_sequence.md, LLAMA2-7B FP8 (DGX-H100)"
NEMO_FP8 = {"precision": "fp8", "fp8_scaling": "tensorwise"}
"""NeMo's FP8 is Transformer Engine's (NeMo 24.03: ``fp8=True``, TE's default
``DelayedScaling`` recipe: one scale per tensor from an amax history, E4M3 forward, E5M2
gradients, the ``te.Linear`` / ``LayerNormLinear`` GEMMs of each transformer layer in FP8,
attention and the output layer in bf16): per-tensor scaling, so ``fp8_scaling="tensorwise"``.
Delayed scaling reads the amax of the previous steps, so its casts skip the amax pass that
torchao's dynamic recipe (autopar's) makes: priced here with the dynamic one's casts."""
# torchtitan's context-parallel sweeps (pytorch/torchtitan docs/performance.md at d4c86e3,
# 2025-01-30, the benchmarks of 2024-12 at torchtitan 9dec370 and torch 1963fc8; since moved
# to benchmarks/llama3_h100_202412_torchtitan.md), on the H100s of row 14 (96 GB HBM2e, 2.4
# TB/s, 500 W, ``TORCHTITAN_H100_PEAK``; hosts joined at 400 Gb/s per GPU, a DGX H100's),
# TPS/GPU as torchtitan counts it (train.py: each data-parallel rank's tokens before CP
# shards them, over the step and ``cp * tp * pp``: global tokens / step / GPUs):
# Table 2, "FSDP + CP + torch.compile + Float8. Llama 3.1 8B model. 8 GPUs. Local batch size
# 1. Full activation checkpointing": FSDP 4, CP 2, 65536: 2,540; FSDP 2, CP 4, 131072: 1,071
# and FSDP 8, CP 1, 32768: 3,890; FSDP 1, CP 8, 262144: 548 (row 29).
# Table 6, "4D parallelism (FSDP + TP + PP + CP) + torch.compile + Float8 + AsyncTP + 1F1B.
# Llama 3.1 405B model. 512 GPUs (TP 8, PP8). Local batch size 8. Full activation
# checkpointing": FSDP 4, CP 2, 65536: 47; FSDP 2, CP 4, 131072: 31; FSDP 8, CP 1, 32768: 76
# (FSDP 1, CP 8, 262144: 16 not added). As run at 9dec370: the local batch is per FSDP rank
# (global = local x FSDP degree); K/V all-gathered
# (``--experimental.context_parallel_rotate_method`` defaults to "allgather"), torch's CP load-balanced head-tail (``_cp_options.
# enable_load_balance = True``, the layout autopar plans); FSDP2 over the data and context
# ranks together (``dp_shard_cp``: ZeRO-3 here, which shards over data and context), reducing
# in fp32; under PP not resharding after forward (``apply_fsdp``: ``reshard_after_forward =
# False``: ZeRO-2 here, as rows 15-16); PP's micro-batches the default, its degree (8, one
# sequence each: the table states none, the default assumed); AdamW foreach. Not priced:
# Float8 linears, torch.compile (refused beside ``context=``), AsyncTP: each run's error
# includes their gain.
TT_CP = "torchtitan performance.md (d4c86e3)"
# torchtitan's Float8 rows (the same 2024-12 benchmarks, Tables 1, 3, 4, 5; TPS/GPU as above):
# Table 1 "1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, global
# batch size 16. Selective activation checkpointing": "FSDP + torch.compile + Float8" 8,532
# (row 14 is the table's eager bf16 "FSDP" row, 5,762); Table 3, the same on 128 GPUs (global
# batch 256): 8,380; Table 4 "2D parallelism (FSDP + TP) + torch.compile + Float8. Llama 3.1
# 70B model. 256 GPUs (FSDP 32, TP 8). Local batch size 16, global batch size 512. Full
# activation checkpointing": "2D" 829 (its "2D + AsyncTP" row, 876, not added: AsyncTP is
# not priced); Table 5 "3D parallelism (FSDP + TP + PP) + torch.compile + Float8 + AsyncTP.
# Llama 3.1 405B model. 512 GPUs (FSDP 8, TP 8, PP8). Local batch size 32, global batch
# size 256. Full activation checkpointing": 1F1B 100 (interleaved 128: the virtual-stage
# count is not stated). Sequence 8,192 (the train configs' ``seq_len``). Float8 at 9dec370 is
# torchao's dynamic tensorwise recipe (``float8.enable_float8_linear``; rowwise came to
# torchtitan's config later), on every ``nn.Linear`` but the output head
# (``float8.py``: ``module_filter_fn`` skips ``output``): ``precision="fp8"``,
# ``fp8_scaling="tensorwise"``, which converts the same linears
# (``autopar.analysis.fp8_layers``). PP's micro-batches as the CP rows: torchtitan's default,
# one per stage (8 of 4 sequences). Compiled: ``compile=True``.
TT_FP8 = "torchtitan llama3_h100_202412_torchtitan.md"
TT_FLOAT8 = {"precision": "fp8", "fp8_scaling": "tensorwise"}
TT_CP_COST = "torch CP's cost beyond attention's work (not identified; docstring)"
TT_FLOAT8_CP = {**TT_FLOAT8, "lacks": f"{TT_CP_COST}; torch.compile (refused beside context=)"}
TT_FLOAT8_CP_ATP = {**TT_FLOAT8, "lacks": f"{TT_CP_COST}; torch.compile (refused beside "
                    "context=), AsyncTP"}
TT_H100 = {"memory_bytes": 96 * 2**30, "mem_bandwidth": 2.4e12,
           "peak_flops": TORCHTITAN_H100_PEAK, **FA2_H100}
ATTENTION_FLOPS = "full"
"""How Llama 3's Table 4 counts a step's FLOPs (rows 15, 16, 20: ``attention_flops``): its
TFLOP/s per GPU are its "BF16 Model FLOPs Utilization (MFU; Chowdhery et al. (2023))"
(Dubey et al. 2024, Sec. 3.3.2) times the H100's 989 TFLOP/s (380 / 989 = 38%, 430 / 989 =
43%, as the table's MFU column), and Chowdhery et al.'s MFU (PaLM, Appendix B) counts
``6N + 12LHQT`` a token: attention's matmuls over the whole ``T x T`` square, with no
causal saving (torchtitan, Meta's own trainer, writes the same count and says so:
``get_num_flop_per_token`` at 9dec370, "we follow the convention and do not account for
sparsity in causal attention"). The causal count (6 l s h) undercounts the 128k row's
published FLOPs by 29% (its attention is 40% of the causal count) and the 8k rows' by 4%."""
NEMO_FLOPS = "full"
"""How NeMo's performance pages count a step's FLOPs (rows 21, 22: ``attention_flops``):
the long-sequence page does not say, but the same team's summary page of the next release
(NeMo ``docs/source/performance/performance_summary.md``, NeMo 24.07, DGX-H100) gives both
tokens/s and TFLOP/s per GPU, and their ratio is the whole-square count to 0.1%: Llama 2 7B
at 4,096 tokens 776e12 / 16,847 = 4.606e10 FLOPs a token (whole square 4.61e10, causal
4.29e10), Llama 3 8B at 8,192 697e12 / 12,036 = 5.79e10 (5.79e10 against 5.15e10); NVIDIA's
formulas count so too (NeMo 2 ``flops_formulas.llama2``: ``12 s / h``; Megatron-LM's
``num_floating_point_operations``: ``s / h`` inside its factor 12). The long-sequence page's
own 4k row, 768 TFLOP/s on Llama 2 7B (NeMo 24.03.01), sits just under the summary's 776
(24.07) in the same count; counted causally it would be 826, a newer release slower."""
NEMO_CP_ATTENTION = ("Transformer Engine's context-parallel attention as NeMo 24.03 ran it "
                     "(its ring steps' cuDNN kernels of 2024 and fp32 corrections; priced as "
                     "one fused attention at torch 2.11's measured cuDNN rate: not measured)")
N21 = "Narayanan et al. 2021, Table 1"
MEGATRON_SPLIT = "even-layers"
"""Megatron-LM's pipeline split, as its runs ran: ``num_layers / p`` transformer layers a
stage (``/ (p v)`` a virtual stage), the embedding on the first, the final norm, output layer
and loss on the last (NVIDIA/Megatron-LM: ``megatron/training/arguments.py`` requires
``num_layers`` divisible by the pipeline size; ``megatron/core/transformer/transformer_block.py``
builds that many layers a stage; every pipelined row of Narayanan et al. 2021, Table 1 has
a layer count divisible by its stages: 48/2 ... 128/64), not the stage DP's balanced cuts
(``autopar.options``' ``stage_split``). Rows 4-9 price the same under it (2026-11-29): on
these TP 8 GPTs the DP's cuts were already the even ones. Not pinned: MT-NLG and BLOOM
(Megatron-DeepSpeed, its own partitioning; BLOOM's 70 layers over 12 stages are not even),
Llama 3 405B (Meta's own stack; 126 layers over 16), Qwen3-235B (94 layers over 32 x 3:
Megatron-Core's uneven first/last stages, which the pin does not model) and torchtitan's
PP 8 rows (126 layers over 8)."""
K22 = "Korthikanti et al. 2022, Table 5 (full recompute)"

RUNS: list[Run] = [
    Run("GPT 1.7B", N21, "gpt", 24, 2304, 24, 51200, 2048, 512, 32, "a100", 1, 1,
        micro=16, published_tflops=137, overlap=False, grad_reduce="bf16"),
    Run("GPT 3.6B", N21, "gpt", 30, 3072, 32, 51200, 2048, 512, 64, "a100", 2, 1,
        micro=8, published_tflops=138, held=True, overlap=False, grad_reduce="bf16"),
    Run("GPT 7.5B", N21, "gpt", 36, 4096, 32, 51200, 2048, 512, 128, "a100", 4, 1,
        micro=4, published_tflops=142, overlap=False, grad_reduce="bf16"),
    Run("GPT 18.4B", N21, "gpt", 40, 6144, 48, 51200, 2048, 1024, 256, "a100", 8, 1,
        micro=4, published_tflops=135, held=True, overlap=False, grad_reduce="bf16"),
    Run("GPT 39.1B", N21, "gpt", 48, 8192, 64, 51200, 2048, 1536, 512, "a100", 8, 2,
        micro=1, published_tflops=138, overlap=False, grad_reduce="bf16",
        stage_split=MEGATRON_SPLIT),   # Megatron-LM: even layers a stage
    Run("GPT 76.1B", N21, "gpt", 60, 10240, 80, 51200, 2048, 1792, 1024, "a100", 8, 4,
        micro=1, published_tflops=140, held=True, overlap=False, grad_reduce="bf16",
        stage_split=MEGATRON_SPLIT),   # Megatron-LM: even layers a stage
    Run("GPT 145.6B", N21, "gpt", 80, 12288, 96, 51200, 2048, 2304, 1536, "a100", 8, 8,
        micro=1, published_tflops=148, overlap=False, grad_reduce="bf16",
        stage_split=MEGATRON_SPLIT),   # Megatron-LM: even layers a stage
    Run("GPT 310.1B", N21, "gpt", 96, 16384, 128, 51200, 2048, 2160, 1920, "a100", 8, 16,
        micro=1, published_tflops=155, held=True, overlap=False, grad_reduce="bf16",
        stage_split=MEGATRON_SPLIT),   # Megatron-LM: even layers a stage
    Run("GPT 529.6B", N21, "gpt", 105, 20480, 128, 51200, 2048, 2520, 2520, "a100", 8, 35,
        micro=1, published_tflops=163, overlap=False, grad_reduce="bf16",
        stage_split=MEGATRON_SPLIT),   # Megatron-LM: even layers a stage
    Run("GPT 1008B", N21, "gpt", 128, 25600, 160, 51200, 2048, 3072, 3072, "a100", 8, 64,
        micro=1, published_tflops=163, held=True, overlap=False, grad_reduce="bf16",
        stage_split=MEGATRON_SPLIT),   # Megatron-LM: even layers a stage
    Run("MT-NLG 530B", "Smith et al. 2022, Table 1 (280 nodes)", "gpt", 105, 20480, 128,
        51200, 2048, 1920, 2240, "a100", 8, 35, micro=1, published_tflops=126, overlap=False,
        grad_reduce="bf16", lacks="DeepSpeed pipeline engine's costs beyond Megatron-LM's "
        "(not identified; docstring)"),
    Run("BLOOM 176B", "Le Scao et al. 2022, Sec. 3.4", "gpt", 70, 14336, 112, 250880, 2048,
        2048, 384, "a100", 4, 12, micro=2, published_tflops=150, held=True, zero=1,
        overlap=False, nic_gbps=4 * 100),
    Run("Llama3 8B", "torchtitan performance.md (64 A100)", "llama", 32, 4096, 32, 128256,
        8192, 64, 64, "a100", 1, 1, micro=1, recompute=False, kv_heads=8, ffn=14336,
        zero=3, published_tps=2973, selective_ac=True, torchtitan=True),
    Run("Llama3 70B", "torchtitan performance.md (64 A100)", "llama", 80, 8192, 64, 128256,
        8192, 64, 64, "a100", 1, 1, micro=1, recompute=True, kv_heads=8, ffn=28672,
        zero=3, published_tps=331, held=True, torchtitan=True),
    # torchtitan's H100s (performance.md, Table 1): 96 GB HBM2e at 2.4 TB/s, 500 W power
    # limit, peak compute "between SXM and NVL" (``TORCHTITAN_H100_PEAK``); Llama 3.1 8B,
    # FSDP on 8 GPUs, local batch 2, selective recomputation: 5,762 tokens/s per GPU.
    # Added after the constants were final.
    Run("Llama3 8B", "torchtitan performance.md Table 1 (8 H100)", "llama", 32, 4096, 32,
        128256, 8192, 16, 8, "h100", 1, 1, micro=2, recompute=False, kv_heads=8, ffn=14336,
        zero=3, published_tps=5762, held=True, selective_ac=True, torchtitan=True,
        extra={"memory_bytes": 96 * 2**30, "mem_bandwidth": 2.4e12,
               "peak_flops": TORCHTITAN_H100_PEAK, **FA2_H100},
        lacks="GEMM clock under the 500 W limit (not measured; docstring)"),
    Run("Llama3 405B", "Dubey et al. 2024, Table 4 (8,192 GPUs)", "llama", 126, 16384, 128,
        128256, 8192, 2048, 8192, "h100", 8, 16, micro=1, published_tflops=430,
        kv_heads=8, ffn=53248, recompute=False, zero=2, schedule="interleaved-1f1b", extra=FA2_H100,
        attention_flops=ATTENTION_FLOPS),
    Run("Llama3 405B", "Dubey et al. 2024, Table 4 (16,384 GPUs)", "llama", 126, 16384, 128,
        128256, 8192, 2048, 16384, "h100", 8, 16, micro=1, published_tflops=400,
        kv_heads=8, ffn=53248, recompute=False, zero=2, schedule="interleaved-1f1b", held=True,
        extra=FA2_H100, attention_flops=ATTENTION_FLOPS),
    # mixtures of experts (docstring, "MoE rows"): tokens/s per GPU
    Run("DeepSeek-V3", "DeepSeek-AI 2024, arXiv:2412.19437, Sec. 3.1, Table 1 (2,048 H800)",
        "hf:deepseek-v3", 61, 7168, 128, 129280, 4096, 15360, 2048, "h800", 1, 16, micro=1,
        recompute=False, published_tps=DEEPSEEK_V3_TPS, held=True, expert=64,
        precision="fp8", fp8_scaling="rowwise", schedule="dualpipev", virtual=2,
        lacks="FP8 dispatch"),
    Run("Qwen3 235B-A22B", "Megatron-MoE-ModelZoo best_practice/Qwen3 (256 H100, A2A)",
        "hf:qwen3-235b-a22b", 94, 4096, 64, 151936, 4096, 2048, 256, "h100", 2, 32, micro=1,
        recompute=False, published_tps=QWEN3_235B_TPS, held=True, expert=4, virtual=3,
        schedule="interleaved-1f1b", pin_more={"expert_dispatch": "all-to-all"}),
    # the same run without virtual stages: the stage DP refuses the published 3 (docstring)
    Run("Qwen3 235B-A22B", "the row above with 1F1B, no virtual stages (not as run)",
        "hf:qwen3-235b-a22b", 94, 4096, 64, 151936, 4096, 2048, 256, "h100", 2, 32, micro=1,
        recompute=False, published_tps=QWEN3_235B_TPS, held=True, expert=4,
        pin_more={"expert_dispatch": "all-to-all"}),
    # long context (issue 29): the sequence split over a context axis (above RUNS)
    Run("Llama3 405B 128k", "Dubey et al. 2024, Table 4 (16,384 GPUs, CP 16)", "llama", 126,
        16384, 128, 128256, 131072, 128, 16384, "h100", 8, 16, micro=1, published_tflops=380,
        kv_heads=8, ffn=53248, recompute=False, zero=2, schedule="interleaved-1f1b", held=True,
        context=16, pin_more={"context_attention": "all-gather"}, extra=FA2_H100,
        time_limit_s=120, attention_flops=ATTENTION_FLOPS),
    Run("Llama2 7B 128k", NEMO_LONG + ", 128K", "llama", 32, 4096, 32, 32000, 131072, 8, 128,
        "h100", 4, 1, micro=1, recompute=False, published_tflops=555, kv_heads=32, ffn=11008,
        held=True, context=4, time_limit_s=120, **NEMO_FP8,
        attention_flops=NEMO_FLOPS, lacks=NEMO_CP_ATTENTION),
    Run("Llama2 7B 256k", NEMO_LONG + ", 256K", "llama", 32, 4096, 32, 32000, 262144, 8, 256,
        "h100", 4, 1, micro=1, recompute=False, published_tflops=549, kv_heads=32, ffn=11008,
        held=True, context=8, time_limit_s=120, **NEMO_FP8,
        attention_flops=NEMO_FLOPS, lacks=NEMO_CP_ATTENTION),   # CBC: > 30 s on these ILPs
    # torchtitan's CP sweeps (above RUNS): tokens/s per GPU, Float8 (tensorwise) as run and
    # compiled where autopar compiles (CP 1; ``compile`` is refused beside ``context=``);
    # each table's CP 1 row too, the same tokens per GPU without a context axis
    Run("Llama3 8B 32k", TT_CP + " Table 2 (8 H100, FSDP 8 CP 1)", "llama", 32, 4096, 32,
        128256, 32768, 8, 8, "h100", 1, 1, micro=1, recompute=True, kv_heads=8, ffn=14336,
        zero=3, published_tps=3890, held=True, torchtitan=True, extra=TT_H100,
        time_limit_s=120, pin_more={"compile": True},
        **{**TT_FLOAT8, "lacks": "GEMM clock under the 500 W limit (not measured; row 14)"}),
    Run("Llama3 8B 64k", TT_CP + " Table 2 (8 H100, FSDP 4 CP 2)", "llama", 32, 4096, 32,
        128256, 65536, 4, 8, "h100", 1, 1, micro=1, recompute=True, kv_heads=8, ffn=14336,
        zero=3, published_tps=2540, held=True, torchtitan=True, **TT_FLOAT8_CP, context=2,
        pin_more={"context_attention": "all-gather"}, extra=TT_H100, time_limit_s=120),
    Run("Llama3 8B 128k", TT_CP + " Table 2 (8 H100, FSDP 2 CP 4)", "llama", 32, 4096, 32,
        128256, 131072, 2, 8, "h100", 1, 1, micro=1, recompute=True, kv_heads=8, ffn=14336,
        zero=3, published_tps=1071, held=True, torchtitan=True, **TT_FLOAT8_CP, context=4,
        pin_more={"context_attention": "all-gather"}, extra=TT_H100, time_limit_s=120),
    Run("Llama3 405B 32k", TT_CP + " Table 6 (512 H100, FSDP 8 CP 1)", "llama", 126, 16384,
        128, 128256, 32768, 64, 512, "h100", 8, 8, micro=1, recompute=True, kv_heads=8,
        ffn=53248, zero=2, published_tps=76, held=True, torchtitan=True, extra=TT_H100,
        time_limit_s=120, pin_more={"compile": True}, **{**TT_FLOAT8, "lacks": "AsyncTP"}),
    Run("Llama3 405B 64k", TT_CP + " Table 6 (512 H100, FSDP 4 CP 2)", "llama", 126, 16384,
        128, 128256, 65536, 32, 512, "h100", 8, 8, micro=1, recompute=True, kv_heads=8,
        ffn=53248, zero=2, published_tps=47, held=True, torchtitan=True, **TT_FLOAT8_CP_ATP,
        context=2,
        pin_more={"context_attention": "all-gather"}, extra=TT_H100, time_limit_s=120),
    Run("Llama3 405B 128k", TT_CP + " Table 6 (512 H100, FSDP 2 CP 4)", "llama", 126, 16384,
        128, 128256, 131072, 16, 512, "h100", 8, 8, micro=1, recompute=True, kv_heads=8,
        ffn=53248, zero=2, published_tps=31, held=True, torchtitan=True, **TT_FLOAT8_CP_ATP,
        context=4,
        pin_more={"context_attention": "all-gather"}, extra=TT_H100, time_limit_s=120),
    # Table 2's CP 8 row: FSDP over the 8 context ranks alone (ZeRO-3 over the context axis)
    Run("Llama3 8B 256k", TT_CP + " Table 2 (8 H100, FSDP 1 CP 8)", "llama", 32, 4096, 32,
        128256, 262144, 1, 8, "h100", 1, 1, micro=1, recompute=True, kv_heads=8, ffn=14336,
        zero=3, published_tps=548, held=True, torchtitan=True, **TT_FLOAT8_CP, context=8,
        pin_more={"context_attention": "all-gather"}, extra=TT_H100, time_limit_s=120),
    # torchtitan's Float8 rows (``TT_FP8`` above RUNS): compiled, Float8 linears (tensorwise)
    Run("Llama3 8B fp8", TT_FP8 + " Table 1 (8 H100, FSDP + compile + Float8)", "llama", 32,
        4096, 32, 128256, 8192, 16, 8, "h100", 1, 1, micro=2, recompute=False, kv_heads=8,
        ffn=14336, zero=3, published_tps=8532, held=True, selective_ac=True, torchtitan=True,
        extra=TT_H100, pin_more={"compile": True}, **TT_FLOAT8),
    Run("Llama3 8B fp8", TT_FP8 + " Table 3 (128 H100, FSDP + compile + Float8)", "llama", 32,
        4096, 32, 128256, 8192, 256, 128, "h100", 1, 1, micro=2, recompute=False, kv_heads=8,
        ffn=14336, zero=3, published_tps=8380, held=True, selective_ac=True, torchtitan=True,
        extra=TT_H100, pin_more={"compile": True}, **TT_FLOAT8),
    Run("Llama3 70B fp8", TT_FP8 + " Table 4 (256 H100, FSDP 32 x TP 8, 2D)", "llama", 80,
        8192, 64, 128256, 8192, 512, 256, "h100", 8, 1, micro=16, recompute=True, kv_heads=8,
        ffn=28672, zero=3, published_tps=829, held=True, torchtitan=True, extra=TT_H100,
        pin_more={"compile": True}, time_limit_s=120, **TT_FLOAT8),
    Run("Llama3 405B fp8", TT_FP8 + " Table 5 (512 H100, FSDP 8 x TP 8 x PP 8, 1F1B)", "llama",
        126, 16384, 128, 128256, 8192, 256, 512, "h100", 8, 8, micro=4, recompute=True,
        kv_heads=8, ffn=53248, zero=2, published_tps=100, held=True, torchtitan=True,
        extra=TT_H100, pin_more={"compile": True}, time_limit_s=120,
        **{**TT_FLOAT8, "lacks": "AsyncTP"}),
]


def torchtitan_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``loss_fn`` (``train.py`` at 9dec370): cross entropy of the logits
    upcast to fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(0, 1))


def build(run: Run, batch: int) -> Example:
    if run.arch.startswith("hf:"):
        from autopar.hf_models import build as hf_build
        with torch.device("meta"):
            model, inputs, loss_fn, target = hf_build(run.arch[3:], batch=batch, seq=run.seq)
        return Example(model, inputs, target, loss_fn)
    return _build(run, batch)


def _build(run: Run, batch: int) -> Example:
    """The run's model on the meta device. torchtitan rows (``torchtitan``) as torchtitan
    ran them (its Llama at 9dec370, the commit of the H100 benchmarks): FSDP2 computes with
    the parameters cast to bf16 (``MixedPrecisionPolicy(param_dtype=bfloat16)``), so the
    model is captured in bf16 and priced in its own dtypes (``Captured.native_dtypes``):
    RMSNorm's statistics in fp32 (``x.float()``, as ``examples.llama.RMSNorm`` writes it too)
    and the loss over logits upcast to fp32 (:func:`torchtitan_loss`). Its rotary product
    (complex64 in torchtitan: cast, multiply, cast back, 20 bytes an element) moves what
    ``examples.llama``'s bf16 rotate-half form moves (20)."""
    with torch.device("meta"):
        if run.arch == "gpt":
            model = MegatronGPT(run.layers, run.hidden, run.heads, run.vocab, run.seq)
        else:
            cfg = LlamaConfig(vocab_size=run.vocab, max_seq_len=run.seq, n_layer=run.layers,
                              n_head=run.heads, n_kv_head=run.kv_heads, dim=run.hidden,
                              hidden_dim=run.ffn, rope_theta=500000.0)
            model = Llama(cfg)
            if run.torchtitan and run.context > 1:
                # K/V repeated before torch's CP gathers them (TitanAttention); without a
                # context axis the repeat is priced alike in either form (nothing crosses)
                for layer in model.layers:
                    layer.attention = TitanAttention(cfg)
        ex = _example(model, batch, run.seq, run.vocab)
    if run.torchtitan:
        return replace(ex, model=model.to(torch.bfloat16), loss_fn=torchtitan_loss)
    return ex


def pins_of(run: Run) -> dict:
    pins = {"tensor": run.tensor, "data": run.data, "precision": run.precision,
            "grad_reduce": run.grad_reduce}
    if run.precision == "fp8":
        pins["fp8_scaling"] = run.fp8_scaling or "tensorwise"
        # as run: torchtitan's converter, Transformer Engine's te.Linear layers and DeepSeek
        # convert every linear but the output layer, whatever its price (not chosen per layer)
        pins["fp8_layers"] = "all"
        # as run: ZeRO-3 gathered the weights in bf16 (torchtitan's
        # enable_fsdp_float8_all_gather is off by default at 9dec370; docstring), where
        # autopar gathers a tensorwise fp8 linear's weight in fp8 unless pinned off
        pins["fp8_all_gather"] = False
    if run.recompute:
        pins["recompute"] = "full"
    if run.zero:
        pins["zero"] = run.zero
    if run.expert > 1:
        pins["expert"] = run.expert
    if run.context > 1:
        pins["context"] = run.context
    pins.update(run.pin_more)
    if run.pipeline > 1:
        pins.update(pipeline=run.pipeline, micro_batch_size=run.micro * run.data * run.expert,
                    schedule=run.schedule)
        if run.virtual > 1:
            pins["virtual_stages"] = run.virtual
        if run.stage_split:
            pins["stage_split"] = run.stage_split
    else:
        # no pipeline, as it ran (left free, the search weighs pipelines on several nodes,
        # which may then price a layout the run did not use)
        pins["pipeline"] = 1
        if run.micro * run.data * run.expert < run.batch:
            # gradient accumulation without a pipeline: the published micro-batch per rank
            # (the expert ranks split the batch too)
            pins["micro_batch_size"] = run.micro * run.data * run.expert
    return pins


def run_cluster(run: Run):
    """The run's cluster: DGX nodes of its GPU, or the publication's own variant of them
    (the GPU's memory and bandwidth, ``extra``; the network's line rate, ``nic_gbps``, at
    the same NCCL efficiency as InfiniBand's, ``gpus._IB_EFF``)."""
    if not run.extra and not run.nic_gbps and run.context == 1:
        return f"{run.gpus // 8}xdgx-{run.device}"
    node = NODES[f"dgx-{run.device}"]
    # a published run's context-parallel attention ran its own code and kernels
    # (TransformerEngine's cuDNN one under NeMo, SDPA's under torchtitan), not autopar's
    # pairs and merges: priced at the run's attention efficiency (None: ``attention_efficiency``)
    extra = {"context_attention_efficiency": None, **run.extra}
    dev = replace(node.device, name=node.device.name + "-variant", **extra)
    inter = node.inter
    if run.nic_gbps:
        inter = replace(inter, bandwidth=run.nic_gbps * Gbit * _IB_EFF)
    return Cluster(f"{run.gpus // 8}x{dev.name}", run.gpus // 8, 8, dev, node.intra, inter)


def selective_ac_nodes(cap) -> list[str]:
    """The nodes torchtitan's selective op recomputation runs again in backward
    (``ac_mode=selective``, ``selective_ac_option=op``, torchtitan ``apply_ac``): in each
    transformer block (a module ``layers.<i>``) every op except the ones its policy saves,
    which are scaled-dot-product attention and the odd-numbered matmuls of the block (1st,
    3rd, ...; so the 2nd, 4th, 6th run again: wk, wo, w3 of a Llama block)."""
    matmuls: dict[str, int] = {}
    out = []
    for n in cap.gm.graph.nodes:
        if n.op != "call_function":
            continue
        block = next((path for path, _ in n.meta.get("nn_module_stack", {}).values()
                      if path.rsplit(".", 2)[-2:-1] == ["layers"]), None)
        if block is None:
            continue
        op = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        if op in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention"):
            continue
        if op in ("linear", "mm", "matmul", "addmm"):
            matmuls[block] = matmuls.get(block, 0) + 1
            if matmuls[block] % 2:
                continue            # saved
        out.append(n.name)
    return out


REGATHERED = "all_gather@tensor"
"""The collective torchtitan's op policy runs again (:func:`selective_ac_gathers`): the
tensor axis' all-gathers; FSDP2's gathers of the weights over the data axis are not
recomputed (it gathers them again for backward anyway, priced as ZeRO-3's regather)."""


def selective_ac_gathers(cap) -> list[str]:
    """The nodes whose forward collectives torchtitan's op policy runs again in backward:
    every matmul of a transformer block. The policy saves only what its ``_save_list``
    names (mm, attention, ``_c10d_functional.reduce_scatter_tensor``, max; torchtitan
    ``models/llama3/parallelize_llama.py`` at 820504e, the async TP benchmark's commit), and
    marks everything else ``PREFER_RECOMPUTE``: the sequence-parallel all-gather of a
    norm's output into the column-parallel matmuls is not saved, and the weight gradients
    of those matmuls read its output, so backward gathers it again whether the matmul is
    recomputed or saved. The collectives into a block's matmuls are exactly those
    all-gathers (a row-parallel matmul's reduce-scatter goes into the residual add, and
    is saved)."""
    out = []
    for n in cap.gm.graph.nodes:
        if n.op != "call_function":
            continue
        in_block = any(path.rsplit(".", 2)[-2:-1] == ["layers"]
                       for path, _ in n.meta.get("nn_module_stack", {}).values())
        op = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        if in_block and op in ("linear", "mm", "matmul", "addmm"):
            out.append(n.name)
    return out


def selective_ac_s(cap, plan, cluster, nodes=selective_ac_nodes,
                   gathers=selective_ac_gathers) -> float:
    """Seconds a step spends on a selective recomputation policy (``nodes``: the graph's
    nodes it runs again; default torchtitan's, :func:`selective_ac_nodes`), each op priced
    by the plan's own per-node forward seconds (``solver.pipeline_costs.node_costs``), plus
    the forward collectives into ``gathers`` (default torchtitan's, run again in backward:
    :func:`selective_ac_gathers`; None: none, as Megatron-LM's core-attention policy, which
    holds no collective), times the micro-batches of a step; under a pipeline, a rank's
    share (1 / stages: the repeated layers split evenly)."""
    from step_terms import _solved
    from autopar.solver.pipeline_costs import node_costs
    from autopar.cost_models.hardware import parse_cluster
    cl = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    k0 = 1 if plan.pipeline_stages > 1 else 0
    nc = node_costs(cap, _solved(cap, plan, cl, "adamw"), lambda n: 0.0, axes=plan.mesh_axes[k0:])
    total = sum(nc.node_forward.get(name, 0.0) for name in nodes(cap))
    if gathers is not None:
        total += sum(nc.node_forward_comm_by.get(name, {}).get(REGATHERED, 0.0)
                     for name in gathers(cap))
    m = plan.n_microbatches if plan.pipeline_stages > 1 else plan.accumulate
    # a pipeline rank runs its stages' share of the layers (the graph holds them all)
    return max(m, 1) * total / max(plan.pipeline_stages, 1)


@dataclass
class Priced:
    """One run as priced: the step (seconds) and its parts beside the plan's estimate."""
    step: float                 # seconds a step, every term below included
    plan: object
    cap: object                 # the captured graph the plan was solved on
    optimizer_s: float          # the optimizer step (not in the estimate)
    selective_s: float          # the selective recomputation policy's forward seconds


def predict_parts(run: Run, time_limit_s: float = 30.0) -> Priced:
    """One run priced (:func:`predict`'s step, with its parts and the captured graph).

    The step is the plan's estimate (operators, collectives, bubble) plus what the solver
    does not price yet: the optimizer step, memory-bound over the parameters this GPU holds
    (``cost_models.step.optimizer_step_time``), and the host's per-step constant
    (``cost_models.step.HOST_OVERHEAD_S``); plus how the run ran where autopar's own
    runtime would run otherwise: a reduction that did not overlap backward (``overlap``:
    the estimate's ``overlapped`` row added back) and a selective recomputation policy
    (:func:`selective_ac_s`: torchtitan's, or the run's ``selective_nodes``)."""
    ex = build(run, run.batch)
    cluster = run_cluster(run)
    pins, budget = pins_of(run), None
    if run.selective_ac:
        # torchtitan's own recomputation replaces autopar's: its seconds are added below and
        # the run fitted with it; autopar does not model the policy's memory, so no whole
        # layer is recomputed on top of it (it was: row 14 recomputed all 32, then 14 of 32
        # once the solver chose the fewest) and memory is not checked on these rows
        pins["recompute"], budget = "none", math.inf
    # every fp8 row's stack fused its casts (Transformer Engine, DeepSeek's kernels,
    # torchtitan compiled, also beside context parallelism where autopar does not compile):
    # priced with fused casts, not autopar's op-by-op eager ones (cost_models.fp8.fused_casts)
    with fused_casts() if run.precision == "fp8" else contextlib.nullcontext():
        plan, cap = solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=cluster,
                          pins=pins, memory_budget=budget,
                          time_limit_s=max(time_limit_s, run.time_limit_s))
    params = sum(p.numel() for p in ex.model.parameters())
    # an expert's weights live on 1 of ``expert`` ranks (autopar.ops.experts: the stacks)
    experts = sum(p.numel() for n, p in ex.model.named_parameters() if ".experts." in n)
    params -= experts * (1 - 1 / run.expert)
    local = params / (run.tensor * run.pipeline) / (run.data if run.zero else 1)
    # torchtitan steps AdamW unfused (``foreach``) over FSDP2's fp32 shards of weights and
    # gradients (``optimizer.fused`` is off by default at 9dec370); the others fused
    opt = (optimizer_step_time(local, DEVICES[run.device], optimizer="adamw_foreach", mixed=False)
           if run.torchtitan else optimizer_step_time(local, DEVICES[run.device], mixed=True))
    step = plan.estimate.step_time_s + HOST_OVERHEAD_S + opt
    if not run.overlap:
        step -= plan.estimate.comm.get(OVERLAPPED, 0.0)
    sel = 0.0
    if run.selective_ac:
        sel = (selective_ac_s(cap, plan, cluster, run.selective_nodes, gathers=None)
               if run.selective_nodes else selective_ac_s(cap, plan, cluster))
        step += sel
    return Priced(step, plan, cap, opt, sel)


def predict(run: Run, time_limit_s: float = 30.0):
    """(predicted TFLOP/s per GPU, step seconds, plan) of one run (:func:`predict_parts`)."""
    p = predict_parts(run, time_limit_s)
    step = p.step
    if run.published_tps:
        return run.batch * run.seq / step / run.gpus, step, p.plan
    return run.model_flops() / step / run.gpus / 1e12, step, p.plan


def without_techniques(run: Run) -> Run:
    """The run as it was priced before autopar priced its FP8 GEMMs and DualPipeV: bf16 and,
    for a ``dualpipev`` row, plain 1F1B over one stage a rank (``--before``)."""
    out = replace(run, precision="bf16", fp8_scaling="")
    if run.schedule == "dualpipev":
        out = replace(out, schedule="1f1b", virtual=1)
    return out


def priced_as_run(run: Run) -> bool:
    """Whether the row pins a technique ``--before`` takes away (fp8, DualPipeV)."""
    return run.precision == "fp8" or run.schedule == "dualpipev"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="", help="comma-separated row numbers (default: all)")
    ap.add_argument("--tuned-only", action="store_true",
                    help="skip the held-out rows (for working on constants)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit (s)")
    ap.add_argument("--before", action="store_true",
                    help="also price each FP8 / DualPipeV row without them (bf16, 1F1B) and "
                         "print both")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",") if r] or list(range(len(RUNS)))
    if args.tuned_only:
        rows = [i for i in rows if not RUNS[i].held]
    print("pred / publ: TFLOP/s per GPU (the publication's FLOP count), or tokens/s per GPU "
          "for the torchtitan rows (marked tok/s); prec: the GEMMs' precision as priced "
          "(fp8-t / fp8-r: tensorwise / rowwise); '!' marks a row beyond 20%, lacks: what the "
          "run used that autopar does not price")
    print(f"{'#':>2} {'run':<16}{'GPU':>5}{'n':>6} {'t x p x d(xe)':<12}{'B':>6}{'prec':>6}"
          f"{'pred':>7}{'publ':>6}{'err':>8}{'step s':>8}{'plan s':>7}"
          + (f"{'before':>8}{'err':>8}" if args.before else "") + "  held  source / lacks")
    t_all = time.perf_counter()
    errs, errs_held, before_errs = [], [], []
    for i in rows:
        r = RUNS[i]
        t0 = time.perf_counter()
        try:
            pred, step, _ = predict(r, args.time_limit)
        except Exception as e:  # noqa: BLE001 - reported in the table
            print(f"{i:>2} {r.name:<16} failed: {type(e).__name__}: {str(e).splitlines()[0][:90]}",
                  flush=True)
            continue
        published = r.published_tps or r.published_tflops
        mesh = (f"{r.tensor}x{r.pipeline}x{r.data}" + (f"xe{r.expert}" if r.expert > 1 else "")
                + (f"xc{r.context}" if r.context > 1 else ""))
        err = pred / published - 1
        plan_s = time.perf_counter() - t0
        (errs_held if r.held else errs).append(err)
        before = ""
        if args.before:
            b_err = err
            if priced_as_run(r):
                try:
                    b_pred, _, _ = predict(without_techniques(r), args.time_limit)
                    b_err = b_pred / published - 1
                    before = f"{b_pred:>8.1f}{b_err:>+8.1%}"
                except Exception as e:  # noqa: BLE001
                    before = f"{'failed':>8}{type(e).__name__[:8]:>8}"
                    b_err = math.nan
            else:
                before = f"{'':>8}{'':>8}"
            before_errs.append(b_err)
        prec = (f"fp8-{(r.fp8_scaling or 'tensorwise')[0]}" if r.precision == "fp8"
                else r.precision)
        mark = "!" if abs(err) > 0.2 else " "
        print(f"{i:>2} {r.name:<16}{r.device.upper():>5}{r.gpus:>6} "
              f"{mesh:<12}{r.batch:>6}{prec:>6}{pred:>7.1f}"
              f"{published:>6.0f}{err:>+7.1%}{mark}{step:>8.2f}{plan_s:>7.1f}{before}"
              f"  {'yes' if r.held else '   '}   {r.source}"
              + (" tok/s" if r.published_tps else "")
              + (f"; lacks: {r.lacks}" if r.lacks else ""),
              flush=True)
    every = errs + errs_held
    if every:
        mean = sum(abs(e) for e in every) / len(every)
        print(f"\nmean |error| {mean:.1%} over {len(every)} rows (max {max(abs(e) for e in every):.1%}); "
              + (f"tuned-on {sum(abs(e) for e in errs) / len(errs):.1%} ({len(errs)}), " if errs else "")
              + (f"held out {sum(abs(e) for e in errs_held) / len(errs_held):.1%} ({len(errs_held)})"
                 if errs_held else ""))
        if before_errs and not any(math.isnan(e) for e in before_errs):
            print(f"before (FP8 / DualPipeV rows in bf16 / 1F1B): mean |error| "
                  f"{sum(abs(e) for e in before_errs) / len(before_errs):.1%}")
        print(f"targets: every row within 20%: {'yes' if max(abs(e) for e in every) <= 0.2 else 'NO'}; "
              f"mean within 10%: {'yes' if mean <= 0.10 else 'NO'}")
    print(f"wall time {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
