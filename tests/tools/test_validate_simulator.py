"""scripts/simulate/validate.py's comparison: a prediction against the mean of repeated runs."""


from scripts.simulate.validate import compare, suffix


def test_prediction_is_compared_with_the_mean_of_the_runs():
    report = compare({"total_tokens_per_s": (990.0, [880.0, 920.0]), "tpot_p50_s": (0.02, [0.025])})
    assert report["total_tokens_per_s"]["measured"] == 900.0
    assert report["total_tokens_per_s"]["error_pct"] == 10.0
    assert report["total_tokens_per_s"]["measured_runs"] == [880.0, 920.0]
    assert abs(report["tpot_p50_s"]["error_pct"] - -20.0) < 1e-9


def test_the_first_run_keeps_the_plain_file_names():
    assert [suffix(i) for i in range(3)] == ["", "_2", "_3"]
