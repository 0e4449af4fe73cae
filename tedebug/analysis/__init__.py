"""After the run: statistics as a DataFrame (`load`), the HTML report (`report`, figures in `plots`) and the
comparison of two runs (`compare`).  Needs the ``report`` extra (pandas, matplotlib); the training path never
imports this package.

- `tedebug.analysis.load.load_stats(run_dir)` (also `tedebug.load_stats`): the JSONL record as a DataFrame.
- `tedebug.analysis.report.build_report` / `write_report`: ``tedebug report RUN_DIR``.
- `tedebug.analysis.compare.compare_runs` / `format_comparison`: ``tedebug compare RUN_A RUN_B``.
"""
