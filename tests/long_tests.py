"""The suite's longest checks, marked ``long`` (tests/conftest.py): `make test` leaves them out
so that it runs in under ten minutes on 2 cores, `make test-all` runs them.

Each is a second (third, ...) instance of a property that a faster test `make test` runs still
holds, or an end-to-end run of a script whose parts have their own tests; the value says which.
An id is a file, a test function (all its parameters) or one parametrized test. An id that no
longer names a collected test fails the collection of the whole suite (tests/conftest.py), so
the list cannot go stale silently. Durations: `make test` prints its 25 slowest tests; the
choice was made from full runs' ``--durations=0`` (2026-11-30: 1,559 s of tests on 2 workers;
2026-12-02: 1,461 s; 2026-12-04: 1,212 s; 2026-12-05: 1,074 s).
"""

LONG: dict[str, str] = {
    "tests/test__pipe_fold.py::test_a_search_with_folded_stages_ends_where_whole_stages_end":
        "two pipelined searches of a 16-layer GPT (25 s); the folded stage's prices equal the "
        "whole stage's: test_folded_stage_prices_gpt_as_the_whole_stage",
    "tests/test__pipelined.py::test_a_split_backward_computes_each_gradient_leaf_of_the_"
    "unsharded_step[llama-zb-h1-1-none]": "another compiled ZB-H1 step (10 s); GPT's and the "
    "interleaved LLaMA's run in make test",
    "tests/test__pipelined.py::test_a_split_backward_computes_each_gradient_leaf_of_the_"
    "unsharded_step[llama-zb-h1-1-full]": "the same",
    "tests/test_apply_pipelined.py::test_a_zero_bubble_plan_under_sequence_parallelism_keeps_"
    "its_stash_lean_and_exact[full]": "three more compiled steps (20 s); the selective case "
    "runs in make test, and the full one's extra gathers were measured (docs/checks.md)",
    # scripts run end to end on the CPU (their functions have their own tests)
    "tests/test_evaluate.py::test_tiny_run_writes_every_section_with_numbers":
        "bench_evaluate's run (74 s); its statistic: test_spearman_matches_the_textbook_"
        "example",
    "tests/test_evaluate.py::test_tiny_run_numbers_hang_together": "the same run",
    "tests/test_evaluate.py::test_render_rewrites_the_doc_from_a_run": "the same run",
    "tests/test_gpu_mock_compile.py::test_every_case_compiled_by_the_first_method_that_works":
        "the GPU kit's mocked multi-GPU compile run on CPU (70 s): "
        "test_async_pairs_of_gpu_hlo_and_what_runs_inside_them reads GPU HLO",
    "tests/test_gpu_mock_compile.py::test_collectives_are_read_and_set_beside_the_prediction":
        "the same run",
    "tests/test_gpu_mock_compile.py::test_async_pairs_and_memory_are_read": "the same run",
    "tests/test_gpu_mock_compile.py::test_the_section_is_a_markdown_table_of_every_case":
        "the same run",
    "tests/test_gpu_kit.py::test_every_section_is_there_and_nothing_failed":
        "the GPU kit run on CPU (64 s); tests/test_kernels.py and tests/test_devicefit.py "
        "hold its fits",
    "tests/test_gpu_kit.py::test_kernels_are_timed_with_positive_rates": "the same run",
    "tests/test_gpu_kit.py::test_the_fitted_table_loads_as_a_topology_files_device_efficiency":
        "the same run",
    "tests/test_gpu_kit.py::test_the_flash_attention_efficiency_is_fitted_as_the_kernel_model_"
    "counts": "the same run",
    "tests/test_gpu_kit.py::test_the_step_is_measured_and_predicted": "the same run",
    "tests/test_gpu_kit.py::test_every_operator_is_timed_beside_the_kernel_model": "the same run",
    "tests/test_gpu_kit.py::test_the_step_is_profiled_beside_the_kernel_model": "the same run",
    "tests/test_gpu_kit.py::test_an_earlier_runs_profiles_are_read_again_without_the_device":
        "the same run",
    "tests/test_gpu_kit.py::test_the_markdown_section_has_every_table": "the same run",
    "tests/test_gpu_kit.py::test_a_kernel_filter_keeps_the_named_kernels_only": "a second run",
    "tests/test_notebook.py::test_notebook_runs":
        "the notebook's cells (22 s): test_notebook_is_clean_json; the helper it calls is "
        "tests/test_training.py's",
    # soapjax check: one pipelined check stays (the schedule's collectives)
    "tests/test_check.py::test_check_passes_a_ring_attention_plan":
        "67 s; ring attention's sends: tests/test_attention.py::"
        "test_the_compiled_ring_sends_what_ring_sends_counts[4]",
    "tests/test_check.py::test_check_of_a_pipelined_plan_with_tensor_and_sequence_parallel_"
    "stages": "42 s; test_check_counts_a_pipelined_steps_collectives_as_the_schedule_runs_them "
              "and tests/test_apply_pipelined.py's sequence-parallel stages",
    # exactness: one instance per strategy family stays
    "tests/test_multihost.py::test_two_processes_run_a_pipelined_plan_one_stage_each[uneven]":
        "48 s; test_two_processes_compute_the_single_process_step (processes), "
        "tests/test_apply_pipelined.py's uneven stages",
    "tests/test_apply_pipelined.py::test_an_moe_pipeline_carries_the_stacked_losses_and_"
    "computes_the_microbatched_step[interleaved-none]": "39 s; [1f1b-selective-moe-kept]",
    "tests/test_apply_pipelined.py::test_a_pipelined_plan_computes_the_unsharded_step[gpt-1f1b]":
        "tests/test__pipelined.py's gpt 1F1B",
    "tests/test_apply_pipelined.py::test_a_pipelined_plan_computes_the_unsharded_step"
    "[llama-1f1b]": "[llama-3-1-selective] of test_uneven_stages_compute_the_unsharded_step",
    "tests/test_apply_pipelined.py::test_a_pipelined_plan_computes_the_unsharded_step"
    "[llama-interleaved]": "test_sequence_parallel_stages_compute_the_unsharded_step_and_send_"
                           "their_shards[llama-interleaved]",
    "tests/test_apply_pipelined.py::test_uneven_stages_compute_the_unsharded_step[gpt-3-1-none]":
        "[llama-3-1-selective]",
    "tests/test_apply_pipelined.py::test_selective_recomputation_keeps_the_numbers_and_sits_"
    "between_in_memory": "[llama-3-1-selective] of test_uneven_stages_compute_the_unsharded_"
                         "step; recomputation's memory: tests/test_memory.py",
    "tests/test_checkpoint.py::test_a_data_parallel_checkpoint_restores_under_a_pipelined_plan"
    "[interleaved]": "34 s; test_a_checkpoint_restores_under_another_plan_and_device_count, "
                     "tests/test_apply_pipelined.py::test_shard_training_runs_a_pipelined_plan",
    "tests/test__layer_order.py::test_the_training_helper_keeps_chunk_order_and_steps_exactly":
        "34 s; tests/test_checkpoint.py's pipelined restore (the helper's chunk order) and "
        "this file's layout tests",
    "tests/test_exactness.py::test_the_reference_of_coupled_samples_splits_microbatches_as_"
    "apply_does": "34 s; tests/test_apply_pipelined.py's batch norm and MoE pipelines",
    "tests/test__pipelined.py::test_the_pipelined_step_computes_the_unsharded_step"
    "[gpt-gpipe-saved]": "[gpt-1f1b-saved]; GPipe: test_1f1b_keeps_fewer_activations_than_gpipe",
    "tests/test__pipelined.py::test_the_pipelined_step_computes_the_unsharded_step"
    "[gpt-interleaved-saved]": "tests/test_apply_pipelined.py::test_sequence_parallel_stages_"
                               "compute_the_unsharded_step_and_send_their_shards"
                               "[llama-interleaved]",
    "tests/test__pipelined.py::test_the_pipelined_step_computes_the_unsharded_step"
    "[llama-1f1b-saved]": "[gpt-1f1b-saved]; LLaMA: tests/test_apply_pipelined.py's",
    "tests/test__pipelined.py::test_scatter_gather_sends_one_piece_per_model_replica[model4]":
        "[model2-data2]",
    "tests/test_attention.py::test_ring_attention_is_attention[8-contiguous-True]":
        "31 s; [4-contiguous-True]",
    "tests/test_attention.py::test_ring_attention_is_attention[8-zigzag-True]":
        "21 s; [4-zigzag-True]",
    "tests/test_attention.py::test_the_compiled_ring_sends_what_ring_sends_counts[8]": "[4]",
    "tests/test_apply.py::test_sharded_step_matches_unsharded[inception_v3-data_parallel]":
        "22 s; data parallelism on the other models, convolutions on resnet101",
    "tests/test_apply.py::test_sharded_step_matches_unsharded[resnet101-data_parallel]":
        "[resnet101-searched]",
    "tests/test_apply.py::test_sharded_step_matches_unsharded[rnntc-data_parallel]":
        "[rnntc-searched]",
    "tests/test_apply.py::test_sharded_step_matches_unsharded[nmt-data_parallel]":
        "[nmt-searched]",
    "tests/test_training.py::test_scanned_layers_train_with_the_default_plan"
    "[nnx_scan_transformer]": "tests/test_corpus.py::test_shard_training_float64_gradient_is_"
                              "exact[nnx_scan_transformer]",
    "tests/test_exactness.py::test_grouped_convolutions_split_over_channels_give_exact_"
    "gradients[multiplier2d]": "[depthwise2d]",
    "tests/test_exactness.py::test_grouped_convolutions_split_over_channels_give_exact_"
    "gradients[depthwise1d]": "[depthwise2d]",
    "tests/test_corpus.py::test_one_device_gradient_is_exact[resnet18]":
        "test_cpu8_gradient_is_exact[resnet18-*] (its reference is the one-device step)",
    "tests/test_corpus.py::test_one_device_gradient_is_exact[linen_remat_scan_transformer]":
        "test_cpu8_gradient_is_exact[linen_remat_scan_transformer-*]",
    "tests/test_corpus.py::test_one_device_gradient_is_exact[nnx_scan_transformer]":
        "test_cpu8_gradient_is_exact[nnx_scan_transformer-*]",
    "tests/test_corpus.py::test_one_device_gradient_is_exact[t5_encdec]":
        "test_cpu8_gradient_is_exact[t5_encdec-*]",
    "tests/test_corpus.py::test_shard_training_float32_step_matches[linen_remat_scan_"
    "transformer]": "test_shard_training_float64_gradient_is_exact[linen_remat_scan_transformer]",
    "tests/test_corpus.py::test_shard_training_float32_step_matches[nnx_scan_transformer]":
        "test_shard_training_float64_gradient_is_exact[nnx_scan_transformer]",
    "tests/test_corpus.py::test_shard_training_float32_step_matches[resnet18]":
        "test_shard_training_float64_gradient_is_exact[resnet18]",
    "tests/test_corpus.py::test_every_shard_program_builds[whisper]":
        "the other corpus models' shard programs",
    "tests/test_moe.py::test_dropless_is_the_capacity_form_that_drops_nothing":
        "test_dropless_cpu8_gradient_is_exact",
    "tests/test_gpt_dropout.py::test_a_pipelined_plan_with_dropout_computes_the_unsharded_step":
        "test_sharded_gradients_with_dropout_are_the_unsharded, tests/test_memory.py's "
        "dropout microbatch",
    "tests/test_memory.py::test_microbatches_and_recompute_compute_the_unsharded_step[llama]":
        "[gpt]",
    "tests/test_memory.py::test_zero3_with_recompute_computes_the_unsharded_step[gpt]":
        "[llama]",
    "tests/test_graph.py::test_evaluate_reproduces_the_loss[lenet]": "[gpt2]",
    "tests/test_graph.py::test_evaluate_reproduces_the_loss[rnntc]": "[gpt2]",
    # the big zoo models' summaries
    "tests/test_zoo_large.py::test_gpt_22b_fits_on_8_a100s_at_batch_4":
        "tests/test_memory.py::test_megatron_selective_with_sequence_parallelism_fits[22b-tp8]",
    "tests/test_zoo_large.py::test_a_9b_decoder_at_4096_tokens_fits_on_h100x64":
        "test_every_size_traces_from_shapes",
    "tests/test_distributed_optimizer.py::test_gpt_175b_on_512_a100s_sheds_seven_eighths_of_"
    "the_optimizer_state": "test_the_update_is_on_shards_and_all_gathered",
    # second round: what stays is one instance per strategy family and model family
    "tests/test_multihost.py::test_two_processes_run_a_pipelined_plan_one_stage_each[equal]":
        "33 s; test_two_processes_compute_the_single_process_step (processes), "
        "tests/test_apply_pipelined.py (pipelines)",
    "tests/test_checkpoint.py::test_a_data_parallel_checkpoint_restores_under_a_pipelined_plan"
    "[1f1b]": "33 s; test_a_checkpoint_restores_under_another_plan_and_device_count, "
              "tests/test_apply_pipelined.py::test_shard_training_runs_a_pipelined_plan",
    "tests/test_apply_pipelined.py::test_uneven_stages_compute_the_unsharded_step"
    "[gpt-1-3-full]": "[llama-3-1-selective]",
    "tests/test_apply_pipelined.py::test_sequence_parallel_stages_compute_the_unsharded_step_"
    "and_send_their_shards[gpt-1f1b]": "[llama-interleaved]",
    "tests/test_exactness.py::test_grouped_convolutions_split_over_channels_give_exact_"
    "gradients[grouped2d]": "[depthwise2d] (the same rule for a group's channels)",
    "tests/test_exactness.py::test_xla_still_computes_a_partly_scattered_partial_sum_wrongly":
        "a canary for an XLA fix; the workaround's exactness: "
        "test_vit_with_a_partly_scattered_attention_score_is_exact",
    "tests/test_moe.py::test_one_device_gradient_is_exact":
        "test_cpu8_gradient_is_exact (the same reference)",
    "tests/test_memory.py::test_megatron_selective_with_sequence_parallelism_fits"
    "[175b-tp8-pp8]": "[22b-tp8]",
    "tests/test_graph.py::test_evaluate_reproduces_the_loss[nmt]": "[gpt2]",
    "tests/test_attention.py::test_ring_attention_is_attention[8-contiguous-False]":
        "[4-contiguous-True]",
    "tests/test_flash_attention.py::test_gradients_are_exact[ring_model]":
        "[ring_data_tp_model]",
    "tests/test_cost.py::test_profile_measures_each_signature_once":
        "test_a_split_batch_is_measured_at_its_shard",
    "tests/test_recompute.py::test_the_search_starts_a_chain_from_the_relaxed_best_start":
        "test_the_search_relaxes_a_recomputing_plan_where_the_best_recomputes_nothing",
    "tests/test_cudnn_attention.py::test_applied_on_cpu8_its_gradients_are_exact"
    "[ring_data_tp_model]": "[dp]; ring attention: tests/test_flash_attention.py",
    "tests/test_corpus.py::test_one_device_gradient_is_exact":
        "test_shard_training_float64_gradient_is_exact: the one-device step with the batch split",
    "tests/test_corpus.py::test_shard_training_float32_step_matches":
        "test_shard_training_float64_gradient_is_exact (the helper), "
        "test_cpu8_gradient_is_exact[*-searched] (the plan)",
    "tests/test_corpus.py::test_cpu8_gradient_is_exact[*-fsdp]":
        "[*-searched] on every corpus model; FSDP: tests/test_apply.py, "
        "tests/test_memory.py's ZeRO-3",
    "tests/test_fuzz_exactness.py::test_one_device_is_exact":
        "test_a_random_strategy_is_exact on the same models, against the same reference",
    "tests/test_corpus.py::test_one_device_is_exact":
        "test_a_random_strategy_is_exact on the same models, against the same reference",
    "tests/test_apply.py::test_sharded_step_matches_unsharded[*-random0]":
        "[*-searched]; random strategies: tests/test_fuzz_exactness.py",
    # third round
    "tests/test_corpus.py::test_cpu8_gradient_is_exact[*-megatron]":
        "[*-searched] on every corpus model; Megatron's splits: "
        "tests/test_baselines.py, tests/test_apply.py",
    "tests/test_corpus.py::test_a_random_strategy_is_exact[whisper]":
        "the other corpus models' random strategies; encoder-decoder attention: "
        "test_cpu8_gradient_is_exact[t5_encdec-*]",
    "tests/test__pipelined.py::test_the_stages_send_what_the_schedule_needs[interleaved]":
        "[1f1b]; interleaved sends: tests/test_apply_pipelined.py::test_sequence_parallel_"
        "stages_compute_the_unsharded_step_and_send_their_shards[llama-interleaved]",
    "tests/test_memory.py::test_zero3_with_recompute_gathers_again_as_simulated":
        "test_zero3_with_recompute_computes_the_unsharded_step[llama]; the gathers' price: "
        "tests/test_simulate.py",
    "tests/test_check.py::test_check_warns_of_a_plan_whose_scan_layers_read_other_layouts":
        "16 s; tests/test_plan.py::test_a_layer_reading_its_stacked_slice_in_another_layout_"
        "is_named, tests/test_cli.py::test_simulate_warns_of_a_plan_whose_scan_layers_read_"
        "other_layouts",
    # fourth round (make test at 11 minutes after the third)
    "tests/test_apply.py::test_sharded_step_matches_unsharded[gpt2-data_parallel]":
        "[gpt2-searched], [gpt2-megatron], [gpt2-zero]",
    "tests/test_apply.py::test_sharded_step_matches_unsharded[rnnlm-data_parallel]":
        "[rnnlm-searched], [rnnlm-megatron]",
    "tests/test_apply.py::test_sharded_step_matches_unsharded[alexnet-data_parallel]":
        "[alexnet-searched], [alexnet-megatron]",
    "tests/test_corpus.py::test_resnet18_perturbed_gradient_is_exact[data_parallel]":
        "[searched]",
    "tests/test_gpt_flash.py::test_gradients_are_exact[ring_data_tp_model]":
        "[cp_data_tp_model]; the ring on this layout: tests/test_flash_attention.py::"
        "test_gradients_are_exact[ring_data_tp_model]",
    "tests/test_check.py::test_compiled_flops_per_device_match_the_prediction[*-data-parallel]":
        "[*-megatron] of the same models",
    "tests/test_bench_gpu_sim.py::test_smallest_row_is_predicted_and_a_fitted_efficiency_"
    "slows_it": "test_the_fit_meets_a_rows_published_time_and_its_surrogate_is_close",
    "tests/test_apply_pipelined.py::test_a_pipelined_plan_computes_the_unsharded_step"
    "[gpt-interleaved]": "test_sequence_parallel_stages_compute_the_unsharded_step_and_send_"
                         "their_shards[llama-interleaved] (interleaved, exact), tests/"
                         "test__pipelined.py's gpt 1F1B",
    # fifth round (make test at 10.4 minutes after the fourth)
    "tests/test_apply_pipelined.py::test_stage_to_stage_bytes_are_what_the_simulator_prices"
    "[interleaved]": "[1f1b]",
    "tests/test_apply_pipelined.py::test_selective_recomputation_keeps_the_attention_core_"
    "operators_a_plan_keeps": "test_an_moe_pipeline_carries_the_stacked_losses_and_computes_"
                              "the_microbatched_step[1f1b-selective-moe-kept] (a plan's kept "
                              "operators, exact), [llama-3-1-selective] of the uneven stages",
    "tests/test_training.py::test_scanned_layers_train_with_the_default_plan"
    "[linen_scan_transformer]": "tests/test_corpus.py::test_shard_training_float64_gradient_is_"
                                "exact[linen_scan_transformer] (the helper on that model) and "
                                "its test_cpu8_gradient_is_exact[linen_scan_transformer-"
                                "searched]",
    # sixth round (make test at 11.4 minutes here after the compile flags of tests/conftest.py)
    "tests/test_exactness.py::test_xla_cpu_still_cannot_run_an_fft_split_or_resharded_in_a_"
    "loop": "a canary on XLA itself (9 s, a process of its own); the workarounds it holds up "
            "run in make test: test_fnet_under_microbatches_with_its_norm_split_runs_exact",
    "tests/test_apply.py::test_microbatches_reduce_data_parallel_gradients_once":
        "a strict xfail (an apply gap, docs/checks.md); the same compiled bytes are read by "
        "tests/test_check.py::test_flat_microbatches_sync_the_gradients_as_often_as_xla",
    "tests/test_zoo_large.py::test_every_size_traces_from_shapes[gpt-22b]":
        "the same closed forms at [gpt-1.3b], [gpt-1.7b] and [gpt-6.7b]",
    "tests/test_zoo_large.py::test_every_size_traces_from_shapes[gpt-13b]": "the same",
    "tests/test_fuzz_exactness.py::test_an_interleaved_pipeline_is_drawn_and_exact":
        "a drawn interleaved pipeline checked (13 s): an interleaved step's exactness is "
        "tests/test__pipelined.py::test_the_pipelined_step_computes_the_unsharded_step"
        "[llama-zb-interleaved-saved], its gradients put back in the model's layout "
        "tests/test__layer_order.py's",
    # seventh round (make test at 12.7 minutes here, 756 s on CI, 2026-12-02)
    "tests/test_corpus.py::test_cpu8_gradient_is_exact[*-data_parallel]":
        "test_shard_training_float64_gradient_is_exact: the same strategy on the same 8 devices "
        "through the training helper, every leaf against its own scale",
    "tests/test_corpus.py::test_every_shard_program_builds[unet]":
        "convolutions' shard programs: [resnet18], [convnext], [mobilenet]",
    "tests/test_fuzz_exactness.py::test_a_random_strategy_is_exact[zoo:llama:tiny-deep]":
        "[zoo:llama:tiny]; deep pipelines: tests/test__pipelined.py",
    "tests/test_fuzz_exactness.py::test_a_random_strategy_is_exact[zoo:llama:tiny-flash]":
        "[zoo:llama:tiny]; flash attention: tests/test_flash_attention.py::"
        "test_gradients_are_exact",
    "tests/test_apply.py::test_sharded_step_matches_unsharded[moe-data_parallel]":
        "tests/test_moe.py::test_cpu8_gradient_is_exact[data_parallel] (float64)",
    "tests/test_apply.py::test_sharded_step_matches_unsharded[gpt-data_parallel]":
        "tests/test_gpt_dropout.py::test_sharded_gradients_with_dropout_are_the_unsharded"
        "[data_parallel] (float64)",
    "tests/test_moe.py::test_cpu8_gradient_is_exact[fsdp]":
        "[data_parallel], [searched], [expert_data], [expert_model]; FSDP: tests/test_apply.py",
    "tests/test_moe.py::test_dropless_cpu8_gradient_is_exact[fsdp]": "[searched], [megatron]",
    "tests/test_moe.py::test_dropless_cpu8_gradient_is_exact[data_parallel]":
        "[searched], [megatron]",
    "tests/test_zoo_large.py::test_every_size_traces_from_shapes[gpt-6.7b]":
        "the same closed forms at [gpt-1.3b] and [gpt-1.7b]",
    "tests/test_zoo_large.py::test_every_size_traces_from_shapes[llama-8b-32k]": "[llama-8b-8k]",
    "tests/test_check.py::test_compiled_flops_per_device_match_the_prediction[rnnlm-megatron]":
        "[gpt2-megatron], [mlp-megatron]",
    "tests/test_flash_attention.py::test_the_attention_kept_where_the_rest_recomputes_is_exact"
    "[one device]": "[cpu8]",
    "tests/test_aux.py::test_metrics_and_batch_statistics_come_back_from_the_sharded_step_"
    "exactly[fsdp]": "[data-parallel], [plan] (the aux goes through the same apply whatever "
    "the layout); FSDP's gradients: tests/test_apply.py",
    "tests/test_aux.py::test_metrics_and_batch_statistics_come_back_from_the_sharded_step_"
    "exactly[megatron]": "the same; Megatron's: tests/test_baselines.py",
    # eighth round (make test at 762 s on a clean clone, 2026-12-04, ten corpus models added)
    "tests/test__remat.py::test_check_of_scanned_remat_layers_matches_xla"
    "[nnx_scan_transformer-expert-rnn-0.05]": "[linen_scan_transformer-megatron-0.01], "
    "[linen_scan_transformer-fsdp-0.01] and test_check_of_rwkv_under_its_own_remat_matches_xla "
    "(a model's own remat priced and run as XLA runs it)",
    "tests/test_corpus.py::test_cpu8_gradient_is_exact[resnet18-searched]":
        "test_shard_training_float64_gradient_is_exact[resnet18] (its default plan on cpu8, every "
        "leaf against its own scale); convolutions' splits: tests/test_exactness.py",
    "tests/test_corpus.py::test_cpu8_gradient_is_exact[linen_remat_scan_transformer-searched]":
        "test_shard_training_float64_gradient_is_exact[linen_remat_scan_transformer]",
    "tests/test_corpus.py::test_cpu8_gradient_is_exact[t5_encdec-searched]":
        "test_shard_training_float64_gradient_is_exact[t5_encdec]",
    # ninth round (make test at 653 s here, 2026-12-04: the graph-only corpus tests made
    # cheaper first, tests/test_corpus.py `traced`)
    "tests/test__remat.py::test_check_of_scanned_remat_layers_matches_xla"
    "[linen_scan_transformer-fsdp-0.01]": "[linen_scan_transformer-megatron-0.01] (the same "
    "model's scanned remat layers, checked against XLA) and "
    "test_check_of_rwkv_under_its_own_remat_matches_xla",
    "tests/test_aux.py::test_metrics_and_batch_statistics_come_back_from_the_sharded_step_"
    "exactly[data-parallel]": "[plan] (a searched plan splits more than the batch)",
    "tests/test_memory.py::test_recompute_gathers_its_activations_again_as_simulated"
    "[llama-full]": "[gpt-full] (full recomputation) and [llama-selective] (LLaMA's)",
    "tests/test__pipelined.py::test_the_pipelined_step_computes_the_unsharded_step"
    "[gpt-1f1b-recomputed]": "[gpt-1f1b-recomputed-whole-microbatches] (1F1B with its layers "
    "recomputed)",
    "tests/test__cotangents.py::test_check_of_byol_prices_no_backward_for_its_target_network"
    "[data_parallel]": "[target_split] (its target operators' batch split over data too: no "
    "gradient synchronisation of theirs, and no cotangent moves)",
    "tests/test_updates.py::test_the_simulator_prices_muons_gathers_as_xla_compiles_them"
    "[_muon_llama]": "[_muon_llama_decayed] (Muon's gradient gathered as priced, and the "
    "parameter its weight decay reads)",
    "tests/test_apply.py::test_sharded_step_matches_unsharded[resnet101-searched]":
        "a searched CNN plan applied exactly: [alexnet-searched] and [lenet-searched]; a residual "
        "network's, the corpus ResNet-18's in tests/test_corpus.py (searched, float64)",
    "tests/test_apply.py::test_sharded_step_matches_unsharded[nmt-searched]":
        "a searched RNN plan applied exactly: [rnntc-searched] and [rnnlm-searched]",
    # tenth round (make test at 562 s here, 2026-12-05): pipelined checks the newer one holds
    "tests/test_check.py::test_a_pipelined_plans_layers_split_samples_the_batch_arrives_"
    "whole_over_once": "test_a_pipelined_plans_hand_off_and_head_are_what_the_simulator_"
    "prices (the layers' samples split over both axes the batch arrives whole over: the same "
    "data groups, XLA's bytes within 2 %)",
    "tests/test_check.py::test_a_pipelined_plans_prologue_makes_its_values_in_the_plans_"
    "layouts": "test_a_pipelined_plans_hand_off_and_head_are_what_the_simulator_prices (its "
    "embedding in a layout of its own too: left to XLA, the same rematerialization)",
    "tests/test_check.py::test_a_pipelined_plans_epilogue_runs_as_the_stages_data_groups_run_"
    "it": "test_a_pipelined_plans_hand_off_and_head_are_what_the_simulator_prices (its head "
    "splits the vocabulary over a group axis: run, stored and priced as the groups run it)",
    # eleventh round (make test at 9:42 here, 686 s on CI, 2026-12-05): float32 repeats of
    # strategy families held in float64 elsewhere
    "tests/test_apply.py::test_sharded_step_matches_unsharded[gpt2-random1]":
        "a second random strategy; random strategies in float64 on every corpus and zoo "
        "subject: tests/test_corpus.py and tests/test_fuzz_exactness.py::test_a_random_"
        "strategy_is_exact",
    "tests/test_apply.py::test_sharded_step_matches_unsharded[gpt2-megatron]":
        "[rnnlm-megatron], [alexnet-megatron]; a transformer's Megatron plan in float64: "
        "tests/test_gpt_dropout.py::test_sharded_gradients_with_dropout_are_the_unsharded"
        "[megatron]",
    "tests/test_apply.py::test_sharded_step_matches_unsharded[gpt2-zero]":
        "[mlp-zero], [lenet-zero]; ZeRO-3 on a transformer in float64: "
        "tests/test_memory.py::test_zero3_with_recompute_computes_the_unsharded_step[llama]",
}
