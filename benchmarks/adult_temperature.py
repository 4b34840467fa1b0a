"""Adult's clipless linear model at epsilon 3 against the cross-entropy's temperature: clean and
certified accuracy (for a linear model the certificate is the exact robust accuracy).

Usage (``benchmarks/RESULTS.md`` section 53d)::

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/adult_temperature.py 0.1 0.3 0.5 0.7 1.0
"""

from __future__ import annotations

import argparse
import warnings

import adult
import robust_twins

from clipless.robustness import certified_accuracy

RADII = [0.1, 0.25, 0.5, 1.0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("temperatures", type=float, nargs="+")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epsilon", type=float, default=3.0)
    args = parser.parse_args()
    data = adult.load("adult", "none", adult.LINEAR_SETTING.get("preprocessing"))
    x, y = data[1].tensors[0].double(), data[1].tensors[1]
    print("| temperature | clean | certified r = " + " / ".join(map(str, RADII)) + " |")
    print("|---|---|---|")
    for temperature in args.temperatures:
        cfg = {
            **adult.CLIPLESS_DEFAULTS,
            **adult.LINEAR_SETTING,
            "epsilon": args.epsilon,
            "temperature": temperature,
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = adult.run_clipless(cfg, args.seed, *data)
        model = robust_twins._plain(result["model"]).double().eval()
        report = certified_accuracy(model, x, y, RADII)
        cells = " / ".join(f"{100 * c:.1f}" for c in report.certified)
        print(f"| {temperature:g} | {100 * report.accuracy:.2f}% | {cells}% |", flush=True)


if __name__ == "__main__":
    main()
