"""The own-vs-rent report's figures as Prometheus gauges, for the dashboard (recomputed every
ledger.report_every_seconds over the last ledger.report_window_seconds; labels: model and backend names only)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge

FIGURES = {  # report field -> (gauge name, help)
    "utilisation": ("llm_gateway_owned_utilisation_ratio", "Share of the window the model's owned backends had at"
                    " least one request in flight."),
    "owned_cost": ("llm_gateway_owned_cost", "What the model's owned backends cost over the window (hourly price"
                   " x window, busy or idle)."),
    "owned_cost_per_million_tokens": ("llm_gateway_owned_cost_per_million_tokens", "Owned cost per million"
                                      " tokens served on owned backends, at the window's utilisation."),
    "rented_price_per_million_tokens": ("llm_gateway_rented_price_per_million_tokens", "The same owned tokens'"
                                        " cost per million at the rented provider's price."),
    "rent_all_cost": ("llm_gateway_rent_all_cost", "What renting every request of the window would have cost."),
    "burstiness": ("llm_gateway_traffic_burstiness", "Peak-to-mean of requests per ledger bucket (per minute"
                   " by default) over the window."),
    "break_even_utilisation": ("llm_gateway_break_even_utilisation_ratio", "Utilisation at which owning would"
                               " have cost what renting did."),
}


class ReportGauges:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.gauges = {field: Gauge(name, text, ["model"], registry=registry)
                       for field, (name, text) in FIGURES.items()}
        self.in_flight_vs_cap = Gauge("llm_gateway_backend_in_flight_vs_cap_ratio", "Average requests in flight"
                                      " over the window divided by the backend's cap.", ["model", "backend"],
                                      registry=registry)
        self.window = Gauge("llm_gateway_report_window_seconds", "The window the own-vs-rent gauges cover.",
                            registry=registry)

    def update(self, report: dict[str, Any]) -> None:
        self.window.set(report["window_seconds"])
        for model, figures in report["models"].items():
            for field, gauge in self.gauges.items():
                value = figures.get(field)
                gauge.labels(model).set(float("nan") if value is None else value)
            for backend in figures["backends"]:
                ratio = backend["in_flight_vs_cap"]
                self.in_flight_vs_cap.labels(model, backend["name"]).set(float("nan") if ratio is None else ratio)
