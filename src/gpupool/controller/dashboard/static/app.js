// gpupool dashboard: plain JavaScript, no dependencies. Every action goes through the REST
// API under /api/v1, with the operator's name in X-Gpupool-Actor for the event log.
"use strict";

(() => {
  const API = "/api/v1";
  const REFRESH_MS = 3000;
  const MODES = ["virtual", "physical", "draining", "isolated"];
  const LEASE_STATES = ["queued", "granted", "active", "idle", "swapped", "migrating", "preempted", "released"];
  const RANGES = [[900, "15m"], [3600, "1h"], [6 * 3600, "6h"], [24 * 3600, "24h"], [7 * 24 * 3600, "7d"]];
  const PALETTE = ["#2563eb", "#ea580c", "#16a34a", "#db2777", "#7c3aed", "#0891b2", "#ca8a04", "#4f46e5", "#65a30d", "#c026d3"];
  const MODE_COLOR = { virtual: "#2563eb", physical: "#7c3aed", draining: "#d97706", isolated: "#dc2626" };

  // ---- small helpers ----------------------------------------------------------------------
  const $ = (sel, root = document) => root.querySelector(sel);
  const $$ = (sel, root = document) => [...root.querySelectorAll(sel)];
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (c) => ESC[c]);
  const enc = encodeURIComponent;
  const clamp = (v, lo, hi) => Math.max(lo, Math.min(hi, v));
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);

  const fmt = {
    int: (v) => (isNum(v) ? Math.round(v).toLocaleString("en-US") : "–"),
    pct: (v, digits = 0) => (isNum(v) ? `${v.toFixed(digits)}%` : "–"),
    // Compute in whole GPUs' worth: 175 (percent of one GPU) is 1.75 GPUs.
    gpus: (pct) => (isNum(pct) ? String(Math.round(pct) / 100) : "–"),
    mib(v) {
      if (!isNum(v)) return "–";
      if (v >= 1024 * 1024) return `${(v / 1024 / 1024).toFixed(1)} TiB`;
      if (v >= 1024) return `${(v / 1024).toFixed(v >= 100 * 1024 ? 0 : 1)} GiB`;
      return `${Math.round(v)} MiB`;
    },
    rate(v) {
      if (!isNum(v)) return "–";
      const units = ["B/s", "kB/s", "MB/s", "GB/s"];
      let i = 0;
      while (v >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
      return `${v.toFixed(v >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
    },
    dur(s) {
      if (!isNum(s)) return "–";
      s = Math.max(0, Math.round(s));
      if (s < 60) return `${s}s`;
      if (s < 3600) return s % 60 ? `${Math.floor(s / 60)}m ${String(s % 60).padStart(2, "0")}s` : `${s / 60}m`;
      if (s < 86400) return `${Math.floor(s / 3600)}h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
      return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
    },
    ago(iso) {
      if (!iso) return "–";
      return `${fmt.dur((Date.now() - Date.parse(iso)) / 1000)} ago`;
    },
    time(iso) {
      if (!iso) return "–";
      const d = new Date(iso);
      return d.toLocaleString([], { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", second: "2-digit" });
    },
  };

  // Colours follow the sorted tenant list, so that a few tenants never share one.
  function tenantColor(name) {
    const i = state.tenantNames.indexOf(name);
    if (i >= 0) return PALETTE[i % PALETTE.length];
    let h = 0;
    for (const ch of String(name)) h = (h * 31 + ch.charCodeAt(0)) >>> 0;
    return PALETTE[h % PALETTE.length];
  }

  function chip(text, cls = "") {
    return `<span class="chip ${esc(cls || text)}">${esc(text)}</span>`;
  }

  function modeChip(gpu) {
    const target = gpu.mode === "draining" && gpu.target_mode ? ` → ${gpu.target_mode}` : "";
    return `<span class="chip ${esc(gpu.mode)}">${esc(gpu.mode + target)}</span>`;
  }

  function meter(frac, { used = null, tall = false, warnAt = 0.85, fullAt = 0.95, tone = "" } = {}) {
    const f = isNum(frac) ? clamp(frac, 0, 1) : 0;
    const cls = ["meter", tall ? "tall" : "", tone, tone ? "" : f >= fullAt ? "full" : f >= warnAt ? "hot" : ""].join(" ");
    const usedBar = isNum(used) ? `<i class="used" style="width:${(clamp(used, 0, 1) * 100).toFixed(1)}%"></i>` : "";
    return `<span class="${cls}"><i style="width:${(f * 100).toFixed(1)}%"></i>${usedBar}</span>`;
  }

  function gpuName(g) { return `${g.node}/${g.index}`; }

  function requestText(l) {
    if (l.physical) return `${l.gpus} × whole GPU`;
    const mem = l.memory_mib == null ? "proportional memory" : fmt.mib(l.memory_mib);
    return `${l.gpus} × ${l.compute_pct ?? 100}% · ${mem}`;
  }

  function placesText(l) {
    if (!l.slices || !l.slices.length) return '<span class="muted">–</span>';
    return l.slices.map((s) => `<a href="#/gpus/${enc(s.gpu_uuid)}">${esc(s.node)}/${s.gpu_index}</a>`).join(", ");
  }

  // ---- the API ----------------------------------------------------------------------------
  // Who is signed in (GET /whoami). The token itself lives in an HttpOnly cookie set by
  // POST /session; scripts never see it. Writes carry the CSRF header the controller asks for.
  const session = {
    who: null,
    set(who) {
      session.who = who;
      $("#actor-name").textContent = who ? who.name : "–";
      $("#actor-role").textContent = who ? ` ${who.role}${who.tenant ? " · " + who.tenant : ""}` : "";
      document.body.classList.toggle("readonly", !who || who.role !== "admin");
    },
    canAct: () => Boolean(session.who && session.who.role === "admin"),
  };

  async function api(path, { method = "GET", body } = {}) {
    const headers = { Accept: "application/json" };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    if (method !== "GET") headers["X-Gpupool-Csrf"] = "1";
    const res = await fetch(API + path, { method, headers, credentials: "same-origin", body: body === undefined ? undefined : JSON.stringify(body) });
    let data = null;
    try { data = await res.json(); } catch { data = null; }
    // Before anyone signed in, a 401 only means "sign in": the form says so without a red
    // API error; once signed in, a 401 means the session ended, and that is said.
    if (res.status === 401 && path !== "/session") showSignIn(session.who ? "Your session has ended: sign in again." : "");
    if (!res.ok) throw new Error((data && (data.detail || data.error)) || `HTTP ${res.status}`);
    return data;
  }

  function showSignIn(reason) {
    const box = $("#signin");
    if (!box.hidden) return;
    session.set(null);
    box.hidden = false;
    const err = $("#signin-error");
    err.textContent = reason || "";
    err.hidden = !reason;
    $("#signin-token").value = "";
    $("#signin-token").focus();
  }

  async function signIn(event) {
    event.preventDefault();
    const token = $("#signin-token").value.trim();
    try {
      const who = await api("/session", { method: "POST", body: { token } });
      session.set(who);
      $("#signin").hidden = true;
      boot();
    } catch (err) {
      const el = $("#signin-error");
      el.textContent = err.message;
      el.hidden = false;
    }
  }

  function toast(text, bad = false) {
    const el = document.createElement("div");
    el.className = `toast${bad ? " bad" : ""}`;
    el.textContent = text;
    $("#toasts").appendChild(el);
    setTimeout(() => el.remove(), bad ? 7000 : 4000);
  }

  // ---- confirmation dialog ------------------------------------------------------------------
  // Every change asks first, names what it will do, and records who did it.
  function confirmAction({ title, body, fields = "", okLabel = "Confirm", danger = false, run }) {
    const dialog = $("#dialog");
    $("#dialog-title").textContent = title;
    $("#dialog-body").innerHTML = `<p>${body}</p>${fields}`;
    if (!session.canAct()) {
      const role = session.who ? session.who.role : "signed-out";
      toast(`Not allowed: a ${role} token only looks; changes need an admin token.`, true);
      return;
    }
    $("#dialog-actor").textContent = session.who.actor;
    const ok = $("#dialog-ok");
    ok.textContent = okLabel;
    ok.className = `btn ${danger ? "danger" : "primary"}`;
    ok.disabled = false;
    $("#dialog-error").hidden = true;
    const form = $("#dialog-form");
    form.onsubmit = async (event) => {
      event.preventDefault();
      ok.disabled = true;
      try {
        const message = await run(new FormData(form));
        dialog.close();
        toast(message || "Done");
        refreshNow();
      } catch (err) {
        showDialogError(err.message);
        ok.disabled = false;
      }
    };
    $("#dialog-cancel").onclick = () => dialog.close();
    dialog.showModal();
    const first = $("#dialog-body input, #dialog-body select");
    (first || ok).focus();
  }

  function showDialogError(text) {
    const el = $("#dialog-error");
    el.textContent = text;
    el.hidden = false;
  }

  // Actions shared by several pages.
  const actions = {
    setMode(gpu, mode) {
      const busy = gpu.leases > 0;
      confirmAction({
        title: `Switch ${gpuName(gpu)} to ${mode}?`,
        body: busy
          ? `The GPU holds ${gpu.leases} lease(s): it drains first (no new leases) and switches to <b>${esc(mode)}</b> once they end.`
          : `The GPU is free and switches to <b>${esc(mode)}</b> at once.`,
        okLabel: `Switch to ${mode}`,
        run: async () => {
          const out = await api(`/gpus/${enc(gpu.uuid)}/mode`, { method: "POST", body: { mode } });
          return `${gpuName(gpu)} is now ${out.mode}${out.target_mode ? ` → ${out.target_mode}` : ""}`;
        },
      });
    },
    drain(gpu) {
      confirmAction({
        title: `Drain ${gpuName(gpu)}?`,
        body: "No new leases are placed on the GPU; the leases it holds keep running. It stays drained until you switch its mode.",
        okLabel: "Drain",
        run: async () => { await api(`/gpus/${enc(gpu.uuid)}/drain`, { method: "POST" }); return `${gpuName(gpu)} is draining`; },
      });
    },
    isolate(gpu) {
      confirmAction({
        title: `Isolate ${gpuName(gpu)}?`,
        body: "The GPU goes out of service: it takes no new leases until an operator clears it. Its current leases keep running.",
        fields: '<label class="field">Reason<input name="reason" required maxlength="500" placeholder="e.g. fan noise, RMA pending"></label>',
        okLabel: "Isolate",
        danger: true,
        run: async (form) => {
          const reason = String(form.get("reason") || "").trim();
          if (!reason) throw new Error("Give a reason: operators after you will read it.");
          await api(`/gpus/${enc(gpu.uuid)}/isolate`, { method: "POST", body: { reason } });
          return `${gpuName(gpu)} isolated`;
        },
      });
    },
    clear(gpu) {
      confirmAction({
        title: `Clear ${gpuName(gpu)}?`,
        body: `The GPU returns to service in <b>${esc(gpu.target_mode || "virtual")}</b> mode and takes leases again.`,
        okLabel: "Clear isolation",
        run: async () => { await api(`/gpus/${enc(gpu.uuid)}/clear`, { method: "POST" }); return `${gpuName(gpu)} back in service`; },
      });
    },
    release(lease) {
      const queued = lease.state === "queued";
      confirmAction({
        title: queued ? `Cancel request ${lease.id}?` : `Release lease ${lease.id}?`,
        body: queued
          ? `The waiting request of <b>${esc(lease.tenant)}</b> (${esc(requestText(lease))}) leaves the queue.`
          : `The lease of <b>${esc(lease.tenant)}</b>${lease.holder ? ` held by <b>${esc(lease.holder)}</b>` : ""} ends now and its GPU capacity returns to the pool. Its holder sees "released by an operator".`,
        okLabel: queued ? "Cancel request" : "Release lease",
        danger: true,
        run: async () => { await api(`/leases/${enc(lease.id)}/release`, { method: "POST" }); return `${lease.id} released`; },
      });
    },
    editQuota(t) {
      const val = (v) => (v == null ? "" : esc(v));
      const mem = t.max_memory_mib == null ? "" : `${Math.round(t.max_memory_mib / 1024)}GiB`;
      confirmAction({
        title: `Quota of ${t.name}`,
        body: "Leave a field empty for no limit. Requests already granted keep running; a raised quota lets waiting requests through at once.",
        fields: `<div class="quota-grid">
          <label class="field">Whole GPUs<input name="max_gpus" type="number" min="0" value="${val(t.max_gpus)}"></label>
          <label class="field">Memory (e.g. 160GiB)<input name="max_memory" value="${esc(mem)}" placeholder="no limit"></label>
          <label class="field">Compute (% of one GPU)<input name="max_compute_pct" type="number" min="0" value="${val(t.max_compute_pct)}"></label>
          <label class="field">Leases<input name="max_leases" type="number" min="0" value="${val(t.max_leases)}"></label>
          <label class="field">Highest priority<input name="max_priority" type="number" min="0" max="1000" value="${val(t.max_priority)}"></label>
          <label class="field">Fair-share weight<input name="weight" type="number" min="0.01" step="any" value="${val(t.weight)}"></label>
        </div>`,
        okLabel: "Save quota",
        run: async (form) => {
          const number = (k) => { const v = String(form.get(k) ?? "").trim(); return v === "" ? null : Number(v); };
          const memory = String(form.get("max_memory") ?? "").trim();
          const body = {
            quota: {
              max_gpus: number("max_gpus"),
              max_memory: memory === "" ? null : memory,
              max_compute_pct: number("max_compute_pct"),
              max_leases: number("max_leases"),
              max_priority: number("max_priority"),
            },
          };
          const weight = number("weight");
          if (weight != null) body.weight = weight;
          await api(`/tenants/${enc(t.name)}`, { method: "PATCH", body });
          return `Quota of ${t.name} saved`;
        },
      });
    },
  };

  // ---- charts: inline SVG -----------------------------------------------------------------
  // The top of an axis with four gridlines, each a round step (1, 1.5, 2, 2.5, ... times 10^k).
  function niceTop(v) {
    if (!(v > 0)) return 4;
    const step = v / 4;
    const p = 10 ** Math.floor(Math.log10(step));
    for (const m of [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) if (m * p >= step) return 4 * m * p;
    return 40 * p;
  }

  function timeLabel(t, span) {
    const d = new Date(t * 1000);
    if (span > 2 * 86400) return d.toLocaleDateString([], { weekday: "short", day: "numeric" });
    return d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  }

  const SVG_NS = "http://www.w3.org/2000/svg";

  function drawChart(el, data, spec) {
    const width = Math.max(el.clientWidth || 600, 280);
    const height = 190;
    const pad = { l: 52, r: 12, t: 10, b: 24 };
    const t = data ? data.t : [];
    const series = spec.series.map((s) => ({ ...s, values: (data && data.series[s.key]) || [] }));
    let top = spec.max || 0;
    for (const s of series) for (const v of s.values) if (isNum(v) && v > top) top = v;
    // Ticks fall on round numbers of the unit people read (GiB, whole requests).
    const unit = spec.unit || 1;
    top = spec.fixedMax || niceTop((top * 1.05) / unit) * unit;
    if (spec.integer) top = Math.max(4, Math.ceil(top / 4) * 4);
    const now = Date.now() / 1000;
    const t1 = t.length ? Math.max(t[t.length - 1], now - 5) : now;
    const t0 = t1 - spec.range;
    const x = (v) => pad.l + ((v - t0) / (t1 - t0)) * (width - pad.l - pad.r);
    const y = (v) => pad.t + (1 - v / top) * (height - pad.t - pad.b);
    const parts = [];
    for (let i = 0; i <= 4; i += 1) {
      const v = (top * i) / 4;
      parts.push(`<line class="grid-line" x1="${pad.l}" x2="${width - pad.r}" y1="${y(v)}" y2="${y(v)}"/>`);
      parts.push(`<text class="axis-label" x="${pad.l - 8}" y="${y(v) + 3.5}" text-anchor="end">${esc(spec.format(v, true))}</text>`);
    }
    for (let i = 0; i <= 5; i += 1) {
      const tv = t0 + ((t1 - t0) * i) / 5;
      parts.push(`<text class="axis-label" x="${x(tv)}" y="${height - 6}" text-anchor="${i === 0 ? "start" : i === 5 ? "end" : "middle"}">${esc(timeLabel(tv, spec.range))}</text>`);
    }
    let any = false;
    for (const s of series) {
      let d = "";
      let area = "";
      let run = [];
      const flush = () => {
        if (run.length && s.area) {
          area += `M${run[0][0]},${y(0)}L${run.map((p) => p.join(",")).join("L")}L${run[run.length - 1][0]},${y(0)}Z`;
        }
        run = [];
      };
      s.values.forEach((v, i) => {
        if (!isNum(v)) { flush(); return; }
        any = true;
        const p = [x(t[i]).toFixed(1), y(clamp(v, 0, top)).toFixed(1)];
        d += `${run.length ? "L" : "M"}${p[0]},${p[1]}`;
        run.push(p);
      });
      flush();
      if (area) parts.push(`<path class="area" d="${area}" fill="${s.color}"/>`);
      if (d) parts.push(`<path class="line" d="${d}" stroke="${s.color}"${s.dash ? ' stroke-dasharray="5 4"' : ""}/>`);
    }
    if (!any) parts.push(`<text class="nodata" x="${(width + pad.l) / 2}" y="${height / 2}" text-anchor="middle">No samples in this range yet</text>`);
    parts.push(`<line class="cursor" x1="0" x2="0" y1="${pad.t}" y2="${height - pad.b}" visibility="hidden"/>`);
    parts.push(`<rect x="${pad.l}" y="${pad.t}" width="${width - pad.l - pad.r}" height="${height - pad.t - pad.b}" fill="transparent"/>`);
    el.innerHTML = `<svg xmlns="${SVG_NS}" viewBox="0 0 ${width} ${height}" preserveAspectRatio="none">${parts.join("")}</svg>`;
    const svg = el.firstChild;
    const cursor = $(".cursor", svg);
    const tip = $("#tooltip");
    svg.addEventListener("mousemove", (event) => {
      if (!t.length) return;
      const box = svg.getBoundingClientRect();
      const px = ((event.clientX - box.left) / box.width) * width;
      const tv = t0 + ((px - pad.l) / (width - pad.l - pad.r)) * (t1 - t0);
      let best = 0;
      for (let i = 1; i < t.length; i += 1) if (Math.abs(t[i] - tv) < Math.abs(t[best] - tv)) best = i;
      const cx = x(t[best]);
      cursor.setAttribute("x1", cx);
      cursor.setAttribute("x2", cx);
      cursor.setAttribute("visibility", "visible");
      const rows = series.map((s) => `<div class="row"><span><i style="background:${s.color}"></i>${esc(s.label)}</span><b>${esc(spec.format(s.values[best]))}</b></div>`);
      tip.innerHTML = `<div class="muted">${esc(new Date(t[best] * 1000).toLocaleString())}</div>${rows.join("")}`;
      tip.hidden = false;
      const left = event.clientX + 16 + 220 > window.innerWidth ? event.clientX - 236 : event.clientX + 16;
      tip.style.left = `${left}px`;
      tip.style.top = `${event.clientY + 12}px`;
    });
    svg.addEventListener("mouseleave", () => { cursor.setAttribute("visibility", "hidden"); tip.hidden = true; });
  }

  function chartPanel(id, title, spec) {
    const legend = spec.series.map((s) => `<span><i class="${s.dash ? "dash" : ""}" style="background:${s.color};color:${s.color}"></i>${esc(s.label)}</span>`).join("");
    return `<div class="chart-block" data-chart="${esc(id)}">
      <div class="toolbar"><h3 style="font-size:13px">${esc(title)}</h3><div class="chart-legend">${legend}</div></div>
      <div class="chart" id="chart-${esc(id)}"></div></div>`;
  }

  function rangeControl() {
    return `<div class="segmented" role="group" aria-label="time range">${RANGES.map(([s, label]) =>
      `<button type="button" class="btn small seg${s === state.range ? " on" : ""}" data-range="${s}">${label}</button>`).join("")}</div>`;
  }

  function bindRange(root, redraw) {
    $$("[data-range]", root).forEach((b) => b.addEventListener("click", () => {
      state.range = Number(b.dataset.range);
      localStorage.setItem("gpupool.range", String(state.range));
      $$("[data-range]", root).forEach((o) => o.classList.toggle("on", o === b));
      redraw();
    }));
  }

  async function drawCharts(charts) {
    const keys = [...new Set(charts.flatMap((c) => c.series.map((s) => s.key)))];
    const points = Math.min(600, Math.max(120, Math.round(window.innerWidth / 3)));
    const data = await api(`/history?keys=${keys.map(enc).join(",")}&range_s=${state.range}&points=${points}`);
    for (const c of charts) {
      const el = document.getElementById(`chart-${c.id}`);
      if (el) drawChart(el, data, { ...c, range: state.range });
    }
  }

  const fmtPctAxis = (v) => (isNum(v) ? `${Math.round(v)}%` : "–");
  const fmtMibAxis = (v) => fmt.mib(v);
  const fmtCount = (v) => (isNum(v) ? (Number.isInteger(v) ? String(v) : v.toFixed(1)) : "–");

  // ---- views ------------------------------------------------------------------------------
  const state = { view: null, range: Number(localStorage.getItem("gpupool.range")) || 3600, busy: false, mapFill: "granted", tenantNames: [] };

  function kpi(label, value, note = "", cls = "", testid = "") {
    return `<div class="panel kpi ${cls}" ${testid ? `data-testid="${testid}"` : ""}><div class="label">${esc(label)}</div>
      <div class="value">${value}</div><div class="note">${note}</div></div>`;
  }

  function alertRows(alerts, empty = "No alerts firing: the pool is healthy.") {
    if (!alerts.length) return `<div class="allclear">${esc(empty)}</div>`;
    return `<div class="alerts">${alerts.map((a) => {
      const uuid = a.labels.UUID;
      const link = uuid ? `<a href="#/gpus/${enc(uuid)}">open GPU</a>` : a.labels.node ? `<a href="#/servers/${enc(a.labels.node)}">open server</a>` : "";
      return `<div class="alert" data-testid="alert">${chip(a.severity)}
        <div><div class="name">${esc(a.name)}</div><div class="summary">${esc(a.summary)}</div></div>
        <div class="when">${a.state === "resolved" ? `resolved ${fmt.ago(a.resolved_at)}` : a.state === "pending" ? `pending since ${fmt.ago(a.active_since)}` : `firing ${fmt.ago(a.fired_at)}`}${link ? ` · ${link}` : ""}</div></div>`;
    }).join("")}</div>`;
  }

  function tileFill(g) {
    if (state.mapFill === "util") return isNum(g.utilization_pct) ? g.utilization_pct / 100 : 0;
    if (state.mapFill === "memory") return isNum(g.memory_used_mib) ? g.memory_used_mib / g.memory_mib : 0;
    return g.mode === "physical" ? (g.leases ? 1 : 0) : Math.min(1, g.compute_granted_pct / 100);
  }

  function tileTitle(g) {
    return `${g.node}/${g.index} · ${g.model}\nmode ${g.mode}${g.target_mode ? ` → ${g.target_mode}` : ""}${g.healthy ? "" : " (unhealthy)"}\n` +
      `granted ${g.compute_granted_pct}% · ${fmt.mib(g.memory_granted_mib)} · ${g.leases} lease(s)\n` +
      `utilisation ${fmt.pct(g.utilization_pct)} · memory used ${fmt.mib(g.memory_used_mib)}`;
  }

  function poolMap(gpus, downNodes) {
    const byNode = new Map();
    for (const g of gpus) {
      if (!byNode.has(g.node)) byNode.set(g.node, []);
      byNode.get(g.node).push(g);
    }
    if (!byNode.size) return '<div class="empty">No GPUs registered yet: start an agent on a GPU server.</div>';
    return [...byNode.entries()].map(([node, list]) => `<div class="node${downNodes.has(node) ? " down" : ""}">
      <header title="${esc(node)}"><a href="#/servers/${enc(node)}">${esc(node)}</a>${downNodes.has(node) ? " · down" : ""}</header>
      <div class="tiles">${list.map((g) => `<a class="tile ${esc(g.mode)}" data-testid="gpu-tile" href="#/gpus/${enc(g.uuid)}" title="${esc(tileTitle(g))}"><i style="height:${(tileFill(g) * 100).toFixed(0)}%"></i></a>`).join("")}</div>
    </div>`).join("");
  }

  const OVERVIEW_CHARTS = [
    { id: "util", format: fmtPctAxis, fixedMax: 100, series: [{ key: "pool.utilization_pct", label: "mean GPU utilisation", color: "#0d9488", area: true }] },
    { id: "compute", format: fmtPctAxis, series: [
      { key: "pool.compute_capacity_pct", label: "capacity", color: "#94a3b8", dash: true },
      { key: "pool.compute_granted_pct", label: "granted", color: "#2563eb", area: true },
      { key: "pool.compute_used_pct", label: "used", color: "#0d9488" },
    ] },
    { id: "memory", format: fmtMibAxis, unit: 1024, series: [
      { key: "pool.memory_capacity_mib", label: "capacity", color: "#94a3b8", dash: true },
      { key: "pool.memory_granted_mib", label: "granted", color: "#7c3aed", area: true },
      { key: "pool.memory_used_mib", label: "used", color: "#db2777" },
    ] },
    { id: "queue", format: fmtCount, integer: true, series: [
      { key: "pool.queue_length", label: "waiting requests", color: "#d97706", area: true },
      { key: "pool.leases_holding", label: "leases holding GPUs", color: "#2563eb" },
    ] },
  ];

  function overviewView() {
    let last = null;
    let down = new Set();
    return {
      title: "Overview",
      async mount(root) {
        root.innerHTML = `
          <div class="grid kpis" id="kpis"></div>
          <div class="grid two">
            <section class="panel"><header><h2>Capacity</h2><span class="sub">granted to leases and in use, GPUs in service</span></header><div class="body capacity" id="capacity"></div></section>
            <section class="panel"><header><h2>Active alerts</h2><a class="sub" href="#/alerts">all alerts and rules →</a></header><div class="body flush" id="ov-alerts"></div></section>
          </div>
          <div class="grid two">
            <section class="panel"><header><h2>GPUs by mode</h2><a class="sub" href="#/gpus">all GPUs →</a></header><div class="body" id="modes"></div></section>
            <section class="panel"><header><h2>Tenants</h2><a class="sub" href="#/tenants">quotas →</a></header><div class="body flush" id="ov-tenants"></div></section>
          </div>
          <section class="panel"><header><h2>History</h2>${rangeControl()}</header>
            <div class="body grid two">${OVERVIEW_CHARTS.map((c) => chartPanel(c.id, { util: "GPU utilisation", compute: "Compute: granted vs used", memory: "GPU memory: granted vs used", queue: "Queue and leases" }[c.id], c)).join("")}</div></section>
          <section class="panel"><header><div><h2>Pool map</h2><span class="sub">one square per GPU, grouped by server; the fill shows</span></div>
            <div class="segmented" id="map-fill">${[["granted", "compute granted"], ["util", "utilisation"], ["memory", "memory used"]].map(([k, l]) => `<button type="button" class="btn small seg${state.mapFill === k ? " on" : ""}" data-fill="${k}">${l}</button>`).join("")}</div></header>
            <div class="body"><div class="map" id="map"></div>
            <div class="legend">${MODES.map((m) => `<span><i style="background:${MODE_COLOR[m]}"></i>${m}</span>`).join("")}</div></div></section>`;
        bindRange(root, () => drawCharts(OVERVIEW_CHARTS));
        $$("[data-fill]", root).forEach((b) => b.addEventListener("click", () => {
          state.mapFill = b.dataset.fill;
          $$("[data-fill]", root).forEach((o) => o.classList.toggle("on", o === b));
          if (last) $("#map").innerHTML = poolMap(last.gpus, down);
        }));
        await this.refresh();
      },
      async refresh() {
        const [o, nodes] = await Promise.all([api("/dashboard/overview"), api("/nodes")]);
        if (state.view !== this) return; // a page left while this loaded: not ours to draw
        last = o;
        down = new Set(nodes.filter((n) => n.state !== "up").map((n) => n.name));
        const m = o.gpus_by_mode;
        const ls = o.leases_by_state;
        const computeFrac = o.compute_capacity_pct ? o.compute_granted_pct / o.compute_capacity_pct : 0;
        const memFrac = o.memory_capacity_mib ? o.memory_granted_mib / o.memory_capacity_mib : 0;
        // One unit per card: shares of the pool's capacity, the amounts in GPUs' worth.
        const usedShare = o.compute_capacity_pct ? o.compute_used_pct / o.compute_capacity_pct : 0;
        // Stranded room is a problem only while a request waits for room it cannot use.
        const fragmented = o.fragmentation > 0.5 && o.queue_length > 0;
        $("#kpis").innerHTML = [
          kpi("GPUs", fmt.int(o.gpus_total), `${m.virtual} virtual · ${m.physical} physical · ${m.draining} draining · ${m.isolated} isolated`, m.isolated ? "warn" : "", "kpi-gpus"),
          kpi("Servers up", `${o.nodes_up}<small>/ ${o.nodes_up + o.nodes_down}</small>`, o.nodes_down ? `${o.nodes_down} down` : "all heartbeating", o.nodes_down ? "bad" : "", "kpi-nodes"),
          kpi("Leases holding", fmt.int(o.leases_holding), `${ls.active || 0} active · ${ls.idle || 0} idle · ${ls.granted || 0} granted`, "", "kpi-leases"),
          kpi("Queue", fmt.int(o.queue_length), o.queue_length ? `longest wait ${fmt.dur(o.queue_oldest_wait_s)}` : "nobody waiting", o.queue_oldest_wait_s > 600 ? "warn" : "", "kpi-queue"),
          kpi("Compute granted", fmt.pct(computeFrac * 100), `${fmt.gpus(o.compute_granted_pct)} of ${fmt.gpus(o.compute_capacity_pct)} GPUs' compute · used ${fmt.pct(usedShare * 100)}`, "", "kpi-compute"),
          kpi("Memory granted", fmt.pct(memFrac * 100), `${fmt.mib(o.memory_granted_mib)} of ${fmt.mib(o.memory_capacity_mib)} · used ${fmt.mib(o.memory_used_mib)}`, "", "kpi-memory"),
          kpi("Utilisation", fmt.pct(o.utilization_pct), "mean of GPUs reporting", "", "kpi-util"),
          kpi("Fragmentation", fmt.pct(o.fragmentation * 100), fragmented ? "free compute stranded beside slices while requests wait" : "free compute beside slices; nothing waits for it", fragmented ? "warn" : "", "kpi-frag"),
          kpi("Alerts firing", fmt.int(o.alerts.length), o.alerts_pending ? `${o.alerts_pending} pending` : "rules evaluated every second", o.alerts.length ? "bad" : "", "kpi-alerts"),
        ].join("");
        const usedFrac = o.compute_capacity_pct ? o.compute_used_pct / o.compute_capacity_pct : 0;
        const memUsedFrac = o.memory_capacity_mib ? o.memory_used_mib / o.memory_capacity_mib : 0;
        $("#capacity").innerHTML = `
          <div class="row"><span class="what">Compute</span>${meter(computeFrac, { used: usedFrac, tall: true, warnAt: 2, fullAt: 2 })}
            <span class="nums"><b>${fmt.gpus(o.compute_granted_pct)}</b> of ${fmt.gpus(o.compute_capacity_pct)} GPUs granted · ${fmt.gpus(o.compute_used_pct)} used</span></div>
          <div class="row"><span class="what">Memory</span>${meter(memFrac, { used: memUsedFrac, tall: true, warnAt: 2, fullAt: 2 })}
            <span class="nums"><b>${fmt.mib(o.memory_granted_mib)}</b> granted · ${fmt.mib(o.memory_used_mib)} used</span></div>
          <div class="legend"><span><i style="background:var(--accent)"></i>granted to leases</span><span><i style="background:#0f766e"></i>in use (telemetry)</span>
            <span>oversubscription ×${o.ratios.compute} compute, ×${o.ratios.memory} memory</span></div>`;
        $("#ov-alerts").innerHTML = alertRows(o.alerts);
        const total = o.gpus_total || 1;
        $("#modes").innerHTML = `<div class="stack">${MODES.map((k) => `<span style="width:${(m[k] / total) * 100}%;background:${MODE_COLOR[k]}" title="${k}: ${m[k]}"></span>`).join("")}</div>
          <div class="legend">${MODES.map((k) => `<span><i style="background:${MODE_COLOR[k]}"></i>${k} <b>${m[k]}</b></span>`).join("")}
          <span>unhealthy <b>${o.gpus_unhealthy}</b></span></div>`;
        const tenants = [...o.tenants].sort((a, b) => b.compute_granted_pct - a.compute_granted_pct || a.name.localeCompare(b.name)).slice(0, 8);
        $("#ov-tenants").innerHTML = `<table><thead><tr><th>Tenant</th><th class="num">Compute</th><th class="num">Memory</th><th class="num">Leases</th><th class="num">Waiting</th></tr></thead><tbody>
          ${tenants.map((t) => `<tr><td><span class="swatch" style="background:${tenantColor(t.name)}"></span><a href="#/leases?tenant=${enc(t.name)}">${esc(t.name)}</a></td>
          <td class="num">${fmt.int(t.compute_granted_pct)}%</td><td class="num">${fmt.mib(t.memory_granted_mib)}</td><td class="num">${t.leases}</td><td class="num">${t.queued}</td></tr>`).join("")}</tbody></table>`;
        $("#map").innerHTML = poolMap(o.gpus, down);
        await drawCharts(OVERVIEW_CHARTS);
      },
    };
  }

  function hostMetrics(s) {
    const memFrac = s.memory_total_mib ? s.memory_used_mib / s.memory_total_mib : null;
    const diskFrac = s.disk_total_mib ? s.disk_used_mib / s.disk_total_mib : null;
    return `<div class="hostline">
      <div class="metric"><div class="k">CPU</div><div class="v">${fmt.pct(s.cpu_pct)} <small>${s.cpu_count ?? "?"} cores</small></div>${meter(isNum(s.cpu_pct) ? s.cpu_pct / 100 : 0)}</div>
      <div class="metric"><div class="k">Load (1 min)</div><div class="v">${isNum(s.load1) ? s.load1.toFixed(2) : "–"}</div>${meter(isNum(s.load1) && s.cpu_count ? s.load1 / s.cpu_count : 0)}</div>
      <div class="metric"><div class="k">Memory</div><div class="v">${fmt.mib(s.memory_used_mib)} <small>of ${fmt.mib(s.memory_total_mib)}</small></div>${meter(memFrac)}</div>
      <div class="metric"><div class="k">Disk</div><div class="v">${fmt.mib(s.disk_used_mib)} <small>of ${fmt.mib(s.disk_total_mib)}</small></div>${meter(diskFrac, { warnAt: 0.8, fullAt: 0.9 })}</div>
      <div class="metric"><div class="k">Network</div><div class="v">↓ ${fmt.rate(s.net_recv_bytes_per_s)} <small>↑ ${fmt.rate(s.net_sent_bytes_per_s)}</small></div></div>
    </div>`;
  }

  function gpuTable(gpus, { model = true } = {}) {
    if (!gpus.length) return '<div class="empty">No GPUs.</div>';
    return `<table><thead><tr><th>GPU</th>${model ? "<th>Model</th>" : ""}<th>Mode</th><th>Utilisation</th><th>Memory used</th><th>Granted</th><th class="num">Temp</th><th class="num">Power</th><th class="num">Leases</th></tr></thead><tbody>
      ${gpus.map((g) => `<tr data-testid="gpu-row"><td><a href="#/gpus/${enc(g.uuid)}">${esc(g.node)}/${g.index}</a></td>
        ${model ? `<td class="muted">${esc(g.model)}</td>` : ""}<td>${modeChip(g)}${g.healthy ? "" : ` ${chip("unhealthy", "isolated")}`}</td>
        <td>${meter(isNum(g.utilization_pct) ? g.utilization_pct / 100 : 0, { warnAt: 2 })}${fmt.pct(g.utilization_pct)}</td>
        <td>${meter(isNum(g.memory_used_mib) ? g.memory_used_mib / g.memory_mib : 0)}${fmt.mib(g.memory_used_mib)}</td>
        <td>${meter(g.compute_granted_pct / 100, { tone: "grant" })}${g.compute_granted_pct}% · ${fmt.mib(g.memory_granted_mib)}</td>
        <td class="num">${isNum(g.temperature_c) ? `${Math.round(g.temperature_c)}°C` : "–"}</td>
        <td class="num">${isNum(g.power_w) ? `${Math.round(g.power_w)} W` : "–"}</td>
        <td class="num">${g.leases}</td></tr>`).join("")}</tbody></table>`;
  }

  function modelsText(gpus) {
    const counts = new Map();
    for (const g of gpus) counts.set(g.model, (counts.get(g.model) || 0) + 1);
    return counts.size ? [...counts].map(([m, n]) => `${n} × ${m}`).join(", ") : "no GPUs";
  }

  function serverCard(s) {
    return `<section class="panel server" data-testid="server">
      <header><div class="name"><h2><a href="#/servers/${enc(s.name)}">${esc(s.name)}</a></h2>${chip(s.up ? "up" : "down")}
        <span class="sub">${esc(modelsText(s.gpus))} · ${esc(s.backend)} backend</span></div>
        <span class="sub">${s.last_seen_s == null ? "no heartbeat since the controller started" : `heartbeat ${fmt.dur(s.last_seen_s)} ago`}</span></header>
      ${hostMetrics(s)}
      <div class="body flush">${gpuTable(s.gpus, { model: false })}</div></section>`;
  }

  function serversView(_m, query) {
    return {
      title: "Servers",
      async mount(root) {
        root.innerHTML = `<div class="toolbar"><div class="filters">
            <label class="field">Server<input id="f-name" placeholder="name contains" value="${esc(query.get("q") || "")}"></label>
            <label class="field">State<select id="f-state"><option value="">all</option><option value="up">up</option><option value="down">down</option></select></label>
          </div><span class="count-note" id="count"></span></div><div id="servers" class="grid"></div>`;
        $("#f-name").addEventListener("input", () => this.refresh());
        $("#f-state").addEventListener("change", () => this.refresh());
        await this.refresh();
      },
      async refresh() {
        const all = await api("/dashboard/servers");
        if (state.view !== this) return; // a page left while this loaded: not ours to draw
        const q = $("#f-name").value.trim().toLowerCase();
        const st = $("#f-state").value;
        const shown = all.filter((s) => (!q || s.name.toLowerCase().includes(q)) && (!st || (st === "up") === s.up));
        $("#count").textContent = `${shown.length} of ${all.length} servers`;
        $("#servers").innerHTML = shown.length ? shown.slice(0, 200).map(serverCard).join("") : '<div class="panel empty">No servers match.</div>';
      },
    };
  }

  function serverView(m) {
    const name = decodeURIComponent(m[1]);
    const charts = [
      { id: "cpu", format: fmtPctAxis, fixedMax: 100, series: [{ key: `node.${name}.cpu_pct`, label: "CPU", color: "#2563eb", area: true }] },
      { id: "mem", format: fmtMibAxis, unit: 1024, series: [{ key: `node.${name}.memory_used_mib`, label: "memory used", color: "#7c3aed", area: true }] },
      { id: "net", format: (v) => fmt.rate(v), series: [
        { key: `node.${name}.net_recv_bytes_per_s`, label: "received", color: "#0d9488", area: true },
        { key: `node.${name}.net_sent_bytes_per_s`, label: "sent", color: "#ea580c" },
      ] },
      { id: "load", format: fmtCount, series: [{ key: `node.${name}.load1`, label: "load (1 min)", color: "#db2777" }] },
    ];
    return {
      title: name,
      crumbs: '<a href="#/servers">Servers</a>',
      async mount(root) {
        root.innerHTML = `<div id="server"></div>
          <section class="panel"><header><h2>History</h2>${rangeControl()}</header>
          <div class="body grid two">${charts.map((c) => chartPanel(c.id, { cpu: "CPU", mem: "Host memory", net: "Network", load: "Load" }[c.id], c)).join("")}</div></section>`;
        bindRange(root, () => drawCharts(charts));
        await this.refresh();
      },
      async refresh() {
        const all = await api("/dashboard/servers");
        if (state.view !== this) return; // a page left while this loaded: not ours to draw
        const s = all.find((x) => x.name === name);
        $("#server").innerHTML = s ? serverCard(s) : `<div class="notice bad">No server named ${esc(name)}.</div>`;
        await drawCharts(charts);
      },
    };
  }

  function gpusView(_m, query) {
    return {
      title: "GPUs",
      async mount(root) {
        root.innerHTML = `<div class="toolbar"><div class="filters">
            <label class="field">Mode<select id="f-mode"><option value="">all</option>${MODES.map((k) => `<option>${k}</option>`).join("")}</select></label>
            <label class="field">Server or model<input id="f-q" placeholder="contains" value="${esc(query.get("q") || "")}"></label>
          </div><span class="count-note" id="count"></span></div>
          <section class="panel"><div class="body flush table-wrap" id="gpus"></div></section>`;
        $("#f-mode").value = query.get("mode") || "";
        $("#f-mode").addEventListener("change", () => this.refresh());
        $("#f-q").addEventListener("input", () => this.refresh());
        await this.refresh();
      },
      async refresh() {
        const o = await api("/dashboard/overview");
        if (state.view !== this) return; // a page left while this loaded: not ours to draw
        const mode = $("#f-mode").value;
        const q = $("#f-q").value.trim().toLowerCase();
        const shown = o.gpus.filter((g) => (!mode || g.mode === mode) && (!q || `${g.node} ${g.model}`.toLowerCase().includes(q)));
        $("#count").textContent = `${shown.length} of ${o.gpus.length} GPUs`;
        $("#gpus").innerHTML = gpuTable(shown);
      },
    };
  }

  function sliceBar(holders, capacity, value, label) {
    const segs = holders.map((h) => {
      const v = value(h);
      const w = capacity ? (v / capacity) * 100 : 0;
      const color = tenantColor(h.tenant);
      return `<a href="#/leases?tenant=${enc(h.tenant)}" data-testid="slice" style="width:${w.toFixed(2)}%;background:${color}" title="${esc(`${h.lease_id} · ${h.tenant}${h.holder ? ` · ${h.holder}` : ""}\n${label(v)} · ${h.state}`)}">
        ${w > 9 ? `${esc(label(v))}<small>${esc(h.holder || h.tenant)}</small>` : ""}</a>`;
    });
    const used = holders.reduce((a, h) => a + value(h), 0);
    const free = Math.max(0, capacity - used);
    return `${segs.join("")}${free > 0 ? `<span class="free">${esc(label(free))} free</span>` : ""}`;
  }

  function gpuView(m) {
    const uuid = decodeURIComponent(m[1]);
    const charts = [
      { id: "gutil", format: fmtPctAxis, fixedMax: 100, series: [
        { key: `gpu.${uuid}.utilization_pct`, label: "utilisation", color: "#0d9488", area: true },
        { key: `gpu.${uuid}.compute_granted_pct`, label: "compute granted", color: "#2563eb", dash: true },
      ] },
      { id: "gmem", format: fmtMibAxis, unit: 1024, series: [
        { key: `gpu.${uuid}.memory_used_mib`, label: "memory used", color: "#db2777", area: true },
        { key: `gpu.${uuid}.memory_granted_mib`, label: "memory granted", color: "#7c3aed", dash: true },
      ] },
    ];
    let current = null;
    return {
      title: "GPU",
      async mount(root) {
        root.innerHTML = `<div id="gpu-notice"></div>
          <section class="panel"><header><div><h2 id="gpu-name">GPU</h2><span class="sub" id="gpu-model"></span></div>
            <div class="actions" id="gpu-actions">
              <!-- disabled until the GPU's state is loaded: refresh() enables what applies -->
              <button type="button" class="btn" data-action="mode-virtual" disabled>Switch to virtual</button>
              <button type="button" class="btn" data-action="mode-physical" disabled>Switch to physical</button>
              <button type="button" class="btn" data-action="drain" disabled>Drain</button>
              <button type="button" class="btn danger" data-action="isolate" disabled>Isolate…</button>
              <button type="button" class="btn" data-action="clear" disabled>Clear isolation</button>
            </div></header>
            <div class="body slices" id="slices"></div></section>
          <section class="panel"><header><h2>Slice holders</h2><span class="sub" id="holders-count"></span></header><div class="body flush" id="holders"></div></section>
          <section class="panel"><header><h2>History</h2>${rangeControl()}</header>
            <div class="body grid two">${charts.map((c) => chartPanel(c.id, c.id === "gutil" ? "Utilisation" : "Memory", c)).join("")}</div></section>
          <div class="grid three">
            <section class="panel"><header><h2>Events of this GPU</h2><a class="sub" href="#/events?subject=${enc(uuid)}">all →</a></header><div class="body flush" id="gpu-events"></div></section>
            <section class="panel"><header><h2>Readings</h2><span class="sub">from the agent's last heartbeat</span></header><div class="body" id="readings"></div></section>
          </div>`;
        const on = (action, fn) => $(`[data-action="${action}"]`, root).addEventListener("click", () => current && fn(current.gpu));
        on("mode-virtual", (g) => actions.setMode(g, "virtual"));
        on("mode-physical", (g) => actions.setMode(g, "physical"));
        on("drain", (g) => actions.drain(g));
        on("isolate", (g) => actions.isolate(g));
        on("clear", (g) => actions.clear(g));
        $("#holders").addEventListener("click", (event) => {
          const b = event.target.closest("[data-release]");
          if (!b || !current) return;
          const h = current.holders.find((x) => x.lease_id === b.dataset.release);
          if (h) actions.release({ id: h.lease_id, tenant: h.tenant, holder: h.holder, state: h.state });
        });
        bindRange(root, () => drawCharts(charts));
        await this.refresh();
      },
      async refresh() {
        let d;
        try {
          d = await api(`/dashboard/gpus/${enc(uuid)}`);
        } catch (err) {
          $("#gpu-notice").innerHTML = `<div class="notice bad">${esc(err.message)}</div>`;
          return;
        }
        if (state.view !== this) return; // a page left while this loaded: not ours to draw
        current = d;
        const g = d.gpu;
        this.crumbs = `<a href="#/servers">Servers</a> / <a href="#/servers/${enc(g.node)}">${esc(g.node)}</a>`;
        setTitle(`GPU ${g.node}/${g.index}`, this.crumbs);
        $("#gpu-name").innerHTML = `${esc(g.node)}/${g.index} ${modeChip(g)} ${g.healthy ? "" : chip("unhealthy", "isolated")}`;
        $("#gpu-model").textContent = `${g.model} · ${fmt.mib(g.memory_mib)} · ${g.uuid}`;
        const mode = g.mode;
        const enable = {
          "mode-virtual": mode === "physical" || (mode === "draining" && g.target_mode !== "virtual"),
          "mode-physical": mode === "virtual" || (mode === "draining" && g.target_mode !== "physical"),
          drain: mode === "virtual" || mode === "physical" || (mode === "draining" && g.target_mode != null),
          isolate: mode !== "isolated",
          clear: mode === "isolated",
        };
        for (const [k, v] of Object.entries(enable)) $(`[data-action="${k}"]`).disabled = !v;
        $("#gpu-notice").innerHTML = mode === "isolated"
          ? `<div class="notice bad"><b>Isolated:</b> ${esc(d.isolation_reason || "no reason given")}</div>`
          : mode === "draining" ? `<div class="notice">Draining${g.target_mode ? ` to <b>${esc(g.target_mode)}</b>` : ""}: no new leases; ${g.leases} lease(s) still hold it.</div>` : "";
        const holders = d.holders;
        $("#slices").innerHTML = `
          <div><div class="axis"><b>Compute</b><span>${g.compute_granted_pct}% granted of ${d.compute_capacity_pct}%${d.compute_capacity_pct > 100 ? " (oversubscribed)" : ""} · ${fmt.pct(g.utilization_pct)} in use</span></div>
            <div class="slicebar" data-testid="compute-bar">${sliceBar(holders, d.compute_capacity_pct, (h) => h.compute_pct, (v) => (holders.some((h) => h.whole) ? "whole GPU" : `${v}%`))}</div></div>
          <div><div class="axis"><b>Memory</b><span>${fmt.mib(g.memory_granted_mib)} granted of ${fmt.mib(d.memory_capacity_mib)} · ${fmt.mib(g.memory_used_mib)} in use</span></div>
            <div class="slicebar" data-testid="memory-bar">${sliceBar(holders, d.memory_capacity_mib, (h) => h.memory_mib, (v) => fmt.mib(v))}</div></div>`;
        $("#holders-count").textContent = `${holders.length} lease(s)`;
        $("#holders").innerHTML = holders.length ? `<table><thead><tr><th>Lease</th><th>Tenant</th><th>Holder</th><th>State</th><th class="num">Compute</th><th class="num">Memory</th><th>Since</th><th></th></tr></thead><tbody>
          ${holders.map((h) => `<tr data-testid="holder-row"><td class="mono"><a href="#/leases?gpu=${enc(uuid)}">${esc(h.lease_id)}</a></td>
            <td><span class="swatch" style="background:${tenantColor(h.tenant)}"></span>${esc(h.tenant)}</td><td class="wrap">${esc(h.holder) || '<span class="muted">–</span>'}</td>
            <td>${chip(h.state)}</td><td class="num">${h.whole ? "whole" : `${h.compute_pct}%`}</td><td class="num">${fmt.mib(h.memory_mib)}</td>
            <td class="muted">${fmt.ago(h.granted_at)}</td><td><button type="button" class="btn small danger" data-release="${esc(h.lease_id)}">Release</button></td></tr>`).join("")}</tbody></table>`
          : '<div class="empty">No lease holds this GPU.</div>';
        const t = d.telemetry || {};
        const row = (k, v) => `<dt>${esc(k)}</dt><dd>${v}</dd>`;
        $("#readings").innerHTML = `<dl class="kv">
          ${row("Utilisation", fmt.pct(g.utilization_pct))}
          ${row("Memory used", `${fmt.mib(g.memory_used_mib)} of ${fmt.mib(g.memory_mib)}`)}
          ${row("Temperature", isNum(t.temperature_c) ? `${t.temperature_c} °C` : "–")}
          ${row("Power", isNum(t.power_w) ? `${t.power_w} W` : "–")}
          ${row("Clocks", isNum(t.sm_clock_mhz) ? `SM ${t.sm_clock_mhz} MHz · memory ${t.mem_clock_mhz ?? "–"} MHz` : "–")}
          ${row("ECC errors", `${t.ecc_uncorrected ?? "–"} uncorrected · ${t.ecc_corrected ?? "–"} corrected`)}
          ${row("Xid errors", `${t.xid_errors ?? 0}${t.xid_last != null ? ` (last Xid ${esc(t.xid_last)})` : ""}`)}
          ${row("Processes", esc((t.processes || []).length))}
          ${row("MPS", t.mps_pipe_dir ? `<code>${esc(t.mps_pipe_dir)}</code>` : '<span class="muted">off</span>')}
          ${row("PCI bus", d.pci_bus_id ? `<code>${esc(d.pci_bus_id)}</code>` : "–")}
          ${row("Simulated", g.simulated ? "yes (fake backend)" : "no")}
        </dl>`;
        const events = await api(`/events?subject=${enc(uuid)}&limit=15`);
        $("#gpu-events").innerHTML = eventTable(events.reverse(), false);
        await drawCharts(charts);
      },
    };
  }

  function leaseTable(leases, { queue = false } = {}) {
    if (!leases.length) return `<div class="empty">${queue ? "Nobody is waiting: every request was granted." : "No leases match."}</div>`;
    const head = queue
      ? "<th class=\"num\">#</th><th>Request</th><th>Tenant</th><th>Asks for</th><th class=\"num\">Priority</th><th>Waiting</th><th>Why</th><th>Holder</th><th></th>"
      : "<th>Lease</th><th>Tenant</th><th>State</th><th>Asks for</th><th>On</th><th class=\"num\">Priority</th><th>Access</th><th>Holder</th><th>Age</th><th></th>";
    const rows = leases.map((l) => {
      const release = l.state === "released" ? "" : `<button type="button" class="btn small danger" data-release="${esc(l.id)}">${l.state === "queued" ? "Cancel" : "Release"}</button>`;
      if (queue) {
        return `<tr data-testid="queue-row"><td class="num">${l.queue_position ?? ""}</td><td class="mono">${esc(l.id)}</td>
          <td><span class="swatch" style="background:${tenantColor(l.tenant)}"></span>${esc(l.tenant)}</td><td>${esc(requestText(l))}</td><td class="num">${l.priority}</td>
          <td>${fmt.dur((Date.now() - Date.parse(l.created_at)) / 1000)}</td><td class="wrap muted">${esc(l.waiting_reason || "")}</td><td class="wrap">${esc(l.holder)}</td><td>${release}</td></tr>`;
      }
      return `<tr data-testid="lease-row" data-lease="${esc(l.id)}"><td class="mono">${esc(l.id)}</td>
        <td><span class="swatch" style="background:${tenantColor(l.tenant)}"></span>${esc(l.tenant)}</td><td>${chip(l.state)}${l.release_reason ? `<div class="muted" style="font-size:11.5px;margin-top:3px">${esc(l.release_reason)}</div>` : ""}</td>
        <td>${esc(requestText(l))}</td><td>${placesText(l)}</td><td class="num">${l.priority}</td><td>${esc(l.access)}</td>
        <td class="wrap">${esc(l.holder) || '<span class="muted">–</span>'}</td><td class="muted">${fmt.ago(l.created_at)}</td><td>${release}</td></tr>`;
    });
    return `<table><thead><tr>${head}</tr></thead><tbody>${rows.join("")}</tbody></table>`;
  }

  function bindRelease(container, getLeases) {
    container.addEventListener("click", (event) => {
      const b = event.target.closest("[data-release]");
      if (!b) return;
      const lease = getLeases().find((l) => l.id === b.dataset.release);
      if (lease) actions.release(lease);
    });
  }

  function leasesView(_m, query) {
    let leases = [];
    const LIMIT = 500;
    return {
      title: "Leases",
      async mount(root) {
        const [tenants, nodes] = await Promise.all([api("/tenants"), api("/nodes")]);
        root.innerHTML = `<div class="toolbar"><div class="filters">
            <label class="field">Tenant<select id="f-tenant"><option value="">all</option>${tenants.map((t) => `<option>${esc(t.name)}</option>`).join("")}</select></label>
            <label class="field">State<select id="f-state"><option value="">live (not released)</option><option value="all">all, with released</option>${LEASE_STATES.map((s) => `<option>${s}</option>`).join("")}</select></label>
            <label class="field">Server<select id="f-node"><option value="">all</option>${nodes.map((n) => `<option>${esc(n.name)}</option>`).join("")}</select></label>
            <label class="field">GPU (UUID)<input id="f-gpu" placeholder="GPU-..." value="${esc(query.get("gpu") || "")}"></label>
          </div><span class="count-note" id="count"></span></div>
          <section class="panel"><div class="body flush table-wrap" id="leases"></div></section>`;
        $("#f-tenant").value = query.get("tenant") || "";
        $("#f-state").value = query.get("state") || "";
        $("#f-node").value = query.get("node") || "";
        const changed = () => {
          const q = new URLSearchParams();
          for (const k of ["tenant", "state", "node", "gpu"]) { const v = $(`#f-${k}`).value.trim(); if (v) q.set(k, v); }
          history.replaceState(null, "", `#/leases${q.toString() ? `?${q}` : ""}`);
          this.refresh();
        };
        ["#f-tenant", "#f-state", "#f-node"].forEach((s) => $(s).addEventListener("change", changed));
        $("#f-gpu").addEventListener("change", changed);
        bindRelease($("#leases"), () => leases);
        await this.refresh();
      },
      async refresh() {
        const q = new URLSearchParams({ limit: String(LIMIT) });
        for (const k of ["tenant", "state", "node", "gpu"]) { const v = $(`#f-${k}`).value.trim(); if (v) q.set(k, v); }
        leases = await api(`/leases?${q}`);
        if (state.view !== this) return; // a page left while this loaded: not ours to draw
        $("#count").textContent = `${leases.length}${leases.length === LIMIT ? "+" : ""} lease(s), newest first`;
        $("#leases").innerHTML = leaseTable(leases);
      },
    };
  }

  function queueView() {
    let entries = [];
    return {
      title: "Queue",
      async mount(root) {
        root.innerHTML = `<div class="grid kpis" id="q-kpis"></div>
          <section class="panel"><header><h2>Waiting requests</h2><span class="sub">in the order they will be served: priority, then first come</span></header>
          <div class="body flush table-wrap" id="queue"></div></section>`;
        bindRelease($("#queue"), () => entries);
        await this.refresh();
      },
      async refresh() {
        const q = await api("/queue");
        if (state.view !== this) return; // a page left while this loaded: not ours to draw
        entries = q.map((e) => ({ ...e.lease, queue_position: e.position }));
        const oldest = entries.reduce((a, l) => Math.max(a, (Date.now() - Date.parse(l.created_at)) / 1000), 0);
        const tenants = new Set(entries.map((l) => l.tenant));
        $("#q-kpis").innerHTML = [
          kpi("Waiting", fmt.int(entries.length), entries.length ? "requests in the queue" : "nobody waits", "", "kpi-waiting"),
          kpi("Longest wait", entries.length ? fmt.dur(oldest) : "–", "alert after 10 minutes", oldest > 600 ? "warn" : ""),
          kpi("Tenants waiting", fmt.int(tenants.size), [...tenants].slice(0, 4).join(", ")),
        ].join("");
        $("#queue").innerHTML = leaseTable(entries, { queue: true });
      },
    };
  }

  function quotaCell(used, limit, format) {
    if (limit == null) return `${format(used)} <span class="muted">/ no limit</span>`;
    const frac = limit ? used / limit : used > 0 ? 1 : 0;
    return `${meter(frac)}${format(used)} <span class="muted">/ ${format(limit)}</span>`;
  }

  function tenantsView() {
    let tenants = [];
    return {
      title: "Tenants",
      async mount(root) {
        root.innerHTML = `<section class="panel"><header><h2>Tenants and quotas</h2><span class="sub">what each tenant holds against its limits</span></header>
          <div class="body flush table-wrap" id="tenants"></div></section>`;
        $("#tenants").addEventListener("click", (event) => {
          const b = event.target.closest("[data-quota]");
          const t = b && tenants.find((x) => x.name === b.dataset.quota);
          if (t) actions.editQuota(t);
        });
        await this.refresh();
      },
      async refresh() {
        tenants = await api("/tenants");
        if (state.view !== this) return; // a page left while this loaded: not ours to draw
        const pct = (v) => `${fmt.int(v)}%`;
        $("#tenants").innerHTML = `<table><thead><tr><th>Tenant</th><th class="num">Weight</th><th>Compute</th><th>Memory</th><th>Whole GPUs</th><th>Leases</th><th class="num">Waiting</th><th class="num">Max priority</th><th></th></tr></thead><tbody>
          ${tenants.map((t) => `<tr data-testid="tenant-row"><td><span class="swatch" style="background:${tenantColor(t.name)}"></span><a href="#/leases?tenant=${enc(t.name)}">${esc(t.name)}</a></td>
            <td class="num">${t.weight}</td><td>${quotaCell(t.used_compute_pct, t.max_compute_pct, pct)}</td><td>${quotaCell(t.used_memory_mib, t.max_memory_mib, fmt.mib)}</td>
            <td>${quotaCell(t.used_gpus, t.max_gpus, fmt.int)}</td><td>${quotaCell(t.used_leases, t.max_leases, fmt.int)}</td>
            <td class="num">${t.queued_leases}</td><td class="num">${t.max_priority ?? '<span class="muted">–</span>'}</td>
            <td><button type="button" class="btn small" data-quota="${esc(t.name)}">Edit quota</button></td></tr>`).join("")}</tbody></table>`;
      },
    };
  }

  function subjectLink(subject) {
    if (/^GPU-/.test(subject)) return `<a href="#/gpus/${enc(subject)}" class="mono">${esc(subject)}</a>`;
    if (/^l-[0-9a-f]+$/.test(subject)) return `<a href="#/leases?state=all" class="mono">${esc(subject)}</a>`;
    return `<span class="mono">${esc(subject)}</span>`;
  }

  function kindChip(kind) {
    const cls = kind.startsWith("alert.firing") ? "critical" : kind.includes("isolat") || kind.includes("down") || kind.includes("failed") ? "isolated"
      : kind.startsWith("alert.resolved") || kind.includes("granted") || kind.includes("cleared") || kind.endsWith(".up") ? "granted"
      : kind.includes("queued") || kind.includes("drain") ? "queued" : "plain";
    return `<span class="chip ${cls}">${esc(kind)}</span>`;
  }

  function eventTable(events, withSubject = true) {
    if (!events.length) return '<div class="empty">No events.</div>';
    return `<table><thead><tr><th>When</th><th>Actor</th><th>Kind</th>${withSubject ? "<th>Subject</th>" : ""}<th>What</th></tr></thead><tbody>
      ${events.map((e) => `<tr data-testid="event-row"><td class="muted" title="${esc(e.at)}">${esc(fmt.time(e.at))}</td><td>${esc(e.actor)}</td><td>${kindChip(e.kind)}</td>
        ${withSubject ? `<td>${subjectLink(e.subject)}</td>` : ""}<td class="wrap">${esc(e.message)}</td></tr>`).join("")}</tbody></table>`;
  }

  function eventsView(_m, query) {
    let events = [];
    const KEEP = 300;
    return {
      title: "Event log",
      async mount(root) {
        root.innerHTML = `<div class="toolbar"><div class="filters">
            <label class="field">Kind<select id="f-kind"><option value="">all</option>${["lease.*", "gpu.*", "node.*", "tenant.*"].map((k) => `<option>${k}</option>`).join("")}</select></label>
            <label class="field">Subject<input id="f-subject" placeholder="GPU, lease, node or tenant" value="${esc(query.get("subject") || "")}"></label>
          </div><span class="count-note">every change, newest first · who did it is in the actor column</span></div>
          <section class="panel"><div class="body flush table-wrap" id="events"></div></section>`;
        const reset = () => { events = []; this.refresh(); };
        $("#f-kind").addEventListener("change", reset);
        $("#f-subject").addEventListener("change", reset);
        await this.refresh();
      },
      async refresh() {
        const q = new URLSearchParams();
        const kind = $("#f-kind").value;
        const subject = $("#f-subject").value.trim();
        if (kind) q.set("kind", kind);
        if (subject) q.set("subject", subject);
        const newest = events.length ? events[0].id : null;
        if (newest != null) { q.set("since_id", String(newest)); q.set("limit", "500"); } else q.set("limit", String(KEEP));
        const got = await api(`/events?${q}`);
        if (state.view !== this) return; // a page left while this loaded: not ours to draw
        events = [...got.reverse(), ...events].slice(0, KEEP);
        $("#events").innerHTML = eventTable(events);
      },
    };
  }

  function alertsView() {
    return {
      title: "Alerts",
      async mount(root) {
        root.innerHTML = `<div id="webhook"></div>
          <section class="panel"><header><h2>Firing</h2><span class="sub" id="evaluated"></span></header><div class="body flush" id="firing"></div></section>
          <div class="grid two">
            <section class="panel"><header><h2>Pending</h2><span class="sub">condition holds, waiting out the rule's "for"</span></header><div class="body flush" id="pending"></div></section>
            <section class="panel"><header><h2>Recently resolved</h2></header><div class="body flush" id="resolved"></div></section>
          </div>
          <section class="panel"><header><h2>Rules</h2><span class="sub">the same rules ship for Prometheus in deploy/prometheus/gpupool-rules.yml</span></header><div class="body flush table-wrap" id="rules"></div></section>`;
        await this.refresh();
      },
      async refresh() {
        const a = await api("/alerts");
        if (state.view !== this) return; // a page left while this loaded: not ours to draw
        $("#evaluated").textContent = a.evaluated_at ? `evaluated ${fmt.ago(a.evaluated_at)}` : "not evaluated yet";
        $("#firing").innerHTML = alertRows(a.firing);
        $("#pending").innerHTML = alertRows(a.pending, "Nothing pending.");
        $("#resolved").innerHTML = alertRows(a.resolved.slice(0, 20), "Nothing resolved recently.");
        const w = a.webhook;
        $("#webhook").innerHTML = w.configured
          ? `<div class="notice${w.last_error ? " bad" : ""}">Alert webhook: ${w.sent} notification(s) sent, ${w.failed} failed${w.last_error ? ` · last error: ${esc(w.last_error)}` : ""}${w.last_sent_at ? ` · last sent ${fmt.ago(w.last_sent_at)}` : ""}</div>`
          : '<div class="notice">No alert webhook configured: alerts show here and in /metrics. Start the controller with <code>--alert-webhook URL</code> to be notified.</div>';
        $("#rules").innerHTML = `<table class="rules" data-testid="rules-table"><thead><tr><th>Rule</th><th>Severity</th><th>For</th><th>Expression (PromQL)</th><th>State</th></tr></thead><tbody>
          ${a.rules.map((r) => `<tr><td><b>${esc(r.name)}</b><div class="muted" style="font-size:12px">${esc(r.description)}</div></td><td>${chip(r.severity)}</td>
            <td>${r.for_s ? fmt.dur(r.for_s) : "at once"}</td><td class="wrap"><code>${esc(r.expr)}</code></td>
            <td>${r.firing ? chip(`${r.firing} firing`, "critical") : r.pending ? chip(`${r.pending} pending`, "pending") : chip("ok", "granted")}</td></tr>`).join("")}</tbody></table>`;
      },
    };
  }

  // ---- routing and the refresh loop --------------------------------------------------------
  const ROUTES = [
    [/^\/?$/, overviewView, "overview"],
    [/^\/servers$/, serversView, "servers"],
    [/^\/servers\/(.+)$/, serverView, "servers"],
    [/^\/gpus$/, gpusView, "gpus"],
    [/^\/gpus\/(.+)$/, gpuView, "gpus"],
    [/^\/leases$/, leasesView, "leases"],
    [/^\/queue$/, queueView, "queue"],
    [/^\/tenants$/, tenantsView, "tenants"],
    [/^\/events$/, eventsView, "events"],
    [/^\/alerts$/, alertsView, "alerts"],
  ];

  function setTitle(title, crumbs = "") {
    $("#title").textContent = title;
    $("#crumbs").innerHTML = crumbs;
    document.title = `${title} · gpupool`;
  }

  function setLive(ok, text) {
    const el = $("#live");
    el.className = `live ${ok ? "ok" : "err"}`;
    $("#live-text").textContent = text;
  }

  let generation = 0;

  async function route() {
    const hash = location.hash.replace(/^#/, "") || "/";
    const [path, qs] = hash.split("?");
    const query = new URLSearchParams(qs || "");
    let match = null;
    let factory = null;
    let nav = "";
    for (const [re, f, n] of ROUTES) {
      match = path.match(re);
      if (match) { factory = f; nav = n; break; }
    }
    $$("#nav a").forEach((a) => a.classList.toggle("active", a.dataset.nav === nav));
    const root = $("#view");
    generation += 1;
    if (!factory) {
      setTitle("Not found");
      root.innerHTML = '<div class="notice bad">No such page. <a href="#/">Back to the overview</a>.</div>';
      state.view = null;
      return;
    }
    const mine = generation;
    const view = factory(match, query);
    state.view = view;
    setTitle(view.title, view.crumbs || "");
    root.innerHTML = '<div class="empty">Loading…</div>';
    try {
      await view.mount(root);
      if (mine === generation) setLive(true, `Live · updated ${new Date().toLocaleTimeString()}`);
    } catch (err) {
      // A page left while it was loading may fail on its missing parts: not news.
      if (mine !== generation) return;
      root.innerHTML = `<div class="notice bad">Could not load this page: ${esc(err.message)}</div>`;
      setLive(false, "Disconnected · retrying");
    }
  }

  async function refreshChrome() {
    const [alerts, pool, tenants] = await Promise.all([api("/alerts"), api("/pool"), api("/tenants")]);
    state.tenantNames = tenants.map((t) => t.name).sort();
    $("#nav-alerts").textContent = alerts.firing.length ? String(alerts.firing.length) : "";
    $("#nav-queue").textContent = pool.queued ? String(pool.queued) : "";
    $("#simulated").hidden = !pool.simulated;
  }

  async function refreshNow() {
    const view = state.view;
    const mine = generation;
    if (state.busy || !view || !view.refresh) return;
    state.busy = true;
    try {
      await Promise.all([view.refresh(), refreshChrome()]);
      if (mine === generation) setLive(true, `Live · updated ${new Date().toLocaleTimeString()}`);
    } catch (err) {
      // A refresh of a page the operator has already left may fail on its missing parts.
      if (mine === generation) setLive(false, `Disconnected · retrying (${err.message})`);
    } finally {
      state.busy = false;
    }
  }

  function tick() {
    // A hidden tab or an open dialog is not refreshed: nothing changes under the operator's hand.
    if (document.hidden || $("#dialog").open || !$("#signin").hidden) return;
    refreshNow();
  }

  let booted = false;

  function boot() {
    refreshChrome().catch(() => {}).finally(route);
    if (booted) return;
    booted = true;
    window.addEventListener("hashchange", route);
    let resize = null;
    window.addEventListener("resize", () => { clearTimeout(resize); resize = setTimeout(refreshNow, 250); });
    setInterval(tick, REFRESH_MS);
  }

  async function start() {
    $("#signin-form").addEventListener("submit", signIn);
    $("#actor").addEventListener("click", async () => {
      if (!confirm("Sign out of the dashboard?")) return;
      await api("/session", { method: "DELETE" }).catch(() => {});
      showSignIn("Signed out.");
    });
    api("/health").then((h) => { $("#version").textContent = `gpupool ${h.version} · ${h.db}`; }).catch(() => {});
    try {
      session.set(await api("/whoami"));
    } catch {
      return; // the sign-in form is up (401) and boots the page once a token is accepted
    }
    boot();
  }

  start();
})();
