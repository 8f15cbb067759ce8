// The console's own script (no inline scripts: the CSP allows only files of this origin).
// Charts of the own-or-rent report, drawn with uPlot from /console/report.json, the admin API's report JSON.
"use strict";
(function () {
  const reports = new Map(); // one fetch per URL, however many charts read it

  function load(src) {
    if (!reports.has(src)) {
      reports.set(src, fetch(src, { credentials: "same-origin", headers: { accept: "application/json" } })
        .then(function (r) { if (!r.ok) { throw new Error("report: HTTP " + r.status); } return r.json(); }));
    }
    return reports.get(src);
  }

  function cumulative(points, field) {
    let sum = 0;
    return points.map(function (p) { const v = p[field]; if (v === null || v === undefined) { return null; } sum += v; return sum; });
  }

  function series(kind, points) {
    const t = points.map(function (p) { return p.t; });
    if (kind === "utilisation") {
      return { data: [t, points.map(function (p) { return p.utilisation * 100; })],
        series: [{}, { label: "utilisation %", stroke: "#0550ae", width: 2 }] };
    }
    return { data: [t, cumulative(points, "owned_cost"), cumulative(points, "rented_cost"), cumulative(points, "rent_all_cost")],
      series: [{}, { label: "owned", stroke: "#116329", width: 2 }, { label: "rented", stroke: "#a40e26", width: 2 },
        { label: "if all rented", stroke: "#8250df", width: 2, dash: [6, 4] }] };
  }

  const plots = new WeakMap(); // chart element -> its uPlot

  function draw(el) {
    load(el.dataset.src).then(function (report) {
      const model = report.models[el.dataset.model];
      if (!model || !model.series.length) { el.textContent = "No data in this window."; return; }
      const s = series(el.dataset.chart, model.series);
      const plot = plots.get(el);
      if (plot) {
        plot.setData(s.data);
        el.dataset.refreshed = String(Number(el.dataset.refreshed || "0") + 1);
      } else {
        const width = Math.max(320, Math.min(el.clientWidth || 800, 1100));
        plots.set(el, new uPlot({ width: width, height: 220, series: s.series,
          axes: [{}, { label: el.dataset.chart === "utilisation" ? "%" : "cost" }] }, s.data, el));
      }
      el.dataset.points = String(model.series.length);
      el.dataset.requests = String(model.series.reduce(function (sum, p) { return sum + p.requests; }, 0));
    }).catch(function (err) { el.textContent = "Could not load the chart: " + err.message; });
  }

  // The charts follow the ledger without a reload: the report is fetched again every data-chart-refresh seconds.
  function refreshLater(root) {
    root.querySelectorAll("[data-chart-refresh]").forEach(function (holder) {
      if (holder.dataset.timer) { return; }
      holder.dataset.timer = String(setInterval(function () {
        reports.clear();
        holder.querySelectorAll("[data-chart]").forEach(draw);
      }, Number(holder.dataset.chartRefresh) * 1000));
    });
  }

  function drawAll(root) {
    if (typeof uPlot === "undefined") { return; }
    root.querySelectorAll("[data-chart]").forEach(function (el) { if (!plots.has(el)) { draw(el); } });
    refreshLater(root);
  }

  function selectOnFocus(root) {
    root.querySelectorAll("[data-select-on-focus]").forEach(function (el) {
      el.addEventListener("focus", function () { el.select(); });
    });
  }

  // A form marked data-reset-on-success is cleared once the server took it (issuing a key: ready for the next).
  document.addEventListener("htmx:afterRequest", function (e) {
    const form = e.detail.elt;
    if (e.detail.successful && form instanceof HTMLFormElement && form.hasAttribute("data-reset-on-success")) {
      form.reset();
    }
  });

  document.addEventListener("DOMContentLoaded", function () { drawAll(document); selectOnFocus(document); });
  document.addEventListener("htmx:afterSettle", function (e) { drawAll(e.target); selectOnFocus(e.target); });
})();
