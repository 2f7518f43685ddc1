import json

import numpy as np
import triton_python_backend_utils as pb_utils


def refused(call):
    try:
        call()
    except pb_utils.TritonModelException as e:
        return str(e)
    return None


def raised(call):
    try:
        call()
    except Exception as e:
        return type(e).__name__
    return None


def numpy_values(gauge, counter, hist):
    """Values as a model computes them with numpy (Triton's binding takes whatever float() takes)."""
    gauge.set(np.array([2.5], np.float32))
    counter.increment(np.int64(1))
    counter.increment(True)
    hist.observe(np.float32(5))
    return gauge.value(), counter.value() >= 2


class TritonPythonModel:
    """Custom metrics as Triton's docs show them, in two instances: per request a counter, a
    gauge set to X, a gauge only incremented by X and a histogram of X. CHECKS reports that
    misuses raise TritonModelException."""

    def initialize(self, args):
        labels = {"model": args["model_name"]}
        # Triton 2.51's kinds are MetricFamily.COUNTER, .GAUGE and .HISTOGRAM (pb_utils has no others).
        self.fr = pb_utils.MetricFamily("metered_requests", "Requests seen", pb_utils.MetricFamily.COUNTER)
        self.requests = self.fr.Metric(labels=labels)
        self.gauges = gauges = pb_utils.MetricFamily("metered_value", "Values", pb_utils.MetricFamily.GAUGE)
        self.last = gauges.Metric(labels={**labels, "kind": "last"})
        self.added = gauges.Metric(labels={**labels, "kind": "added"})
        self.quiet = pb_utils.MetricFamily("metered_quiet", "", pb_utils.MetricFamily.COUNTER).Metric(labels=labels)
        self.hists = pb_utils.MetricFamily("metered_x", "Distribution of X", pb_utils.MetricFamily.HISTOGRAM)
        self.hist = self.hists.Metric(labels=labels, buckets=[1, 10, 100])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = int(pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0])
            self.requests.increment(1)
            self.last.set(x)
            self.added.increment(x)
            self.hist.observe(x)
            checks = {
                "negative_counter": refused(lambda: self.requests.increment(-1)),
                "set_counter": refused(lambda: self.requests.set(3)),
                "histogram_without_buckets": refused(
                    lambda: pb_utils.MetricFamily("metered_h2", "", pb_utils.MetricFamily.HISTOGRAM).Metric()),
                "reserved_name": refused(lambda: pb_utils.MetricFamily("nv_mine", "", pb_utils.MetricFamily.GAUGE)),
                "other_kind": refused(lambda: pb_utils.MetricFamily("metered_requests", "", pb_utils.MetricFamily.GAUGE)),
                "counter_value": self.requests.value() > 0,
                # Triton's texts (python_backend metric_family.cc, core's metric.cc), r24.10
                "labels_list": refused(lambda: self.gauges.Metric(labels=["kind"])),
                "buckets_str": refused(lambda: self.hists.Metric(buckets="1,2")),
                "buckets_unsorted": refused(lambda: self.hists.Metric(labels={"b": "u"}, buckets=[10, 1])),
                "buckets_gauge": refused(lambda: self.gauges.Metric(labels={"kind": "b"}, buckets=[1])),
                "observe_gauge": refused(lambda: self.last.observe(1)),
                "increment_histogram": refused(lambda: self.hist.increment(1)),
                "value_histogram": refused(lambda: self.hist.value()),
                "numpy_values": numpy_values(self.gauges.Metric(labels={"kind": "numpy"}),
                                             self.fr.Metric(labels={"kind": "numpy"}),
                                             self.hists.Metric(labels={"b": "numpy"}, buckets=[np.float32(1), np.int64(10)])),
                "str_value": raised(lambda: self.last.set("1.5")),
                "none_value": raised(lambda: self.last.set(None)),
            }
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("CHECKS", np.array([json.dumps(checks).encode()], dtype=object))]))
        return responses
