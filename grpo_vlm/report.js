// The run report's page (report.py writes it inline): builds the DOM from the JSON blob #report-data.
// Texts go in through textContent only, never as HTML. Images are numbers into data.images (data: URIs),
// texts numbers into data.texts. A rollout row is [text, reward, advantage, length, truncated,
// [each component], extras ({boxes, turns} or 0)]. After the first render the body carries data-render-ms,
// and data-missing-glyphs (characters this browser has no font for), then data-groups, data-pairs,
// data-images-loaded, data-images-broken, data-errors, data-settled-ms and
// data-ready="1" once every image has loaded or failed: what a headless browser's test reads.
"use strict";

const data = JSON.parse(document.getElementById("report-data").textContent);
const TEXTS = data.texts;
const IMAGES = data.images;
const COMPONENTS = data.rollouts.components;
const ACCURACY = COMPONENTS.indexOf(data.accuracy); // -1: no accuracy component, nothing is "right"
const PALETTE = ["#1f77b4", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#ff7f0e"];
const PAGE = 60; // before/after cards shown at a time: a 2,000-sample held-out set stays quick
const GROUPS_PAGE = 64; // group cards of a step shown at a time (the default run's step has 16)

// --- small helpers ----------------------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "style") node.style.cssText = value; // through the CSSOM: the policy allows no style attribute
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child !== null && child !== undefined && child !== false) node.append(child);
  }
  return node;
}

function svgEl(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
}

function fmt(x, digits = 3) {
  if (x === null || x === undefined) return "–";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x) || Math.abs(x) >= 1000) return String(x);
  return x.toFixed(digits);
}

function text(i) {
  return i === null || i === undefined ? "" : TEXTS[i];
}

function isRight(row) {
  return ACCURACY >= 0 && row[5][ACCURACY] !== null && row[5][ACCURACY] >= 1;
}

function duration(s) {
  const m = Math.floor(s / 60), h = Math.floor(m / 60);
  return h ? `${h}h${String(m % 60).padStart(2, "0")}m` : m ? `${m}m${String(Math.round(s % 60)).padStart(2, "0")}s` : `${s.toFixed(1)}s`;
}

function section(id, title, ...children) {
  return el("section", { id }, el("h2", {}, title), ...children);
}

function note(message) {
  return el("p", { class: "note" }, message);
}

// --- images: thumbnails, boxes drawn over them, the lightbox ------------------------------------------------
function boxesSvg(size, layers) {
  // layers: [{boxes: [[x1, y1, x2, y2]], colour, dashed, label}], in original pixels (the viewBox)
  const svg = svgEl("svg", { viewBox: `0 0 ${size[0]} ${size[1]}`, preserveAspectRatio: "none", class: "boxes" });
  const stroke = Math.max(size[0], size[1]) / 100;
  for (const layer of layers) {
    for (const b of layer.boxes || []) {
      if (!Array.isArray(b) || b.length !== 4) continue;
      const rect = { x: b[0], y: b[1], width: Math.max(0, b[2] - b[0]), height: Math.max(0, b[3] - b[1]) };
      const attrs = { ...rect, fill: "none", stroke: layer.colour, "stroke-width": stroke * (layer.dashed ? 1.6 : 1) };
      if (layer.dashed) attrs["stroke-dasharray"] = `${stroke * 3} ${stroke * 2}`;
      const node = svgEl("rect", attrs);
      node.append(svgEl("title", {}));
      node.firstChild.textContent = `${layer.label}: [${b.map(v => fmt(v, 1)).join(", ")}]`;
      svg.append(node);
    }
  }
  return svg;
}

function targetBoxes(target) {
  if (!target) return [];
  if (Array.isArray(target.boxes)) return target.boxes;
  return Array.isArray(target.bbox) ? [target.bbox] : [];
}

function thumb(entry, layers) {
  // the caption: the original size, and the file's name (an in-memory image's description is in the tooltip)
  const name = entry.ref && !entry.ref.startsWith("<") ? entry.ref.split("/").pop() : "";
  const caption = el("figcaption", { title: entry.ref || "" },
    [entry.size ? `${entry.size[0]}×${entry.size[1]}` : "", name].filter(Boolean).join(" · ") || entry.ref || "");
  if (entry.t === null || entry.t === undefined) {
    return el("figure", { class: "thumb missing" }, el("div", { class: "placeholder" }, entry.why || "no thumbnail"),
      caption);
  }
  const img = el("img", { src: IMAGES[entry.t], alt: entry.ref || "image", title: "click: the image as the model saw it" });
  const frame = el("div", { class: "frame", onclick: () => lightbox(entry) }, img);
  if (layers && layers.some(l => (l.boxes || []).length) && entry.size) frame.append(boxesSvg(entry.size, layers));
  return el("figure", { class: "thumb" }, frame, caption,
    entry.why ? el("div", { class: "why" }, entry.why) : null);
}

function lightbox(entry) {
  const seen = entry.s !== null && entry.s !== undefined;
  const img = el("img", { src: IMAGES[seen ? entry.s : entry.t], alt: entry.ref || "image" });
  const caption = el("p", {});
  const box = el("div", { id: "lightbox", onclick: () => box.remove() }, img, caption);
  img.addEventListener("load", () => {
    const w = img.naturalWidth, h = img.naturalHeight;
    // NOTE: a 56-px image is unreadable at its size: whole multiples, pixels kept sharp, up to ~560 px
    const scale = Math.max(1, Math.min(10, Math.floor(560 / Math.max(w, h))));
    img.style.width = `${w * scale}px`;
    const what = seen ? "as the model saw it" : "the thumbnail (the image as the model saw it is not in this report)";
    caption.textContent = `${w}×${h} px, ${what}${scale > 1 ? ` · shown ×${scale}` : ""} · ${entry.ref || ""}`;
  });
  document.body.append(box);
}

// --- the run ----------------------------------------------------------------------------------------------
// Each start of the run (run.json "starts": a resumed run has several): its time, step and command line.
function commands(starts) {
  if (!starts.length) return "not recorded (a run folder of an earlier version)";
  return starts.map(s => el("div", {}, el("code", {}, s.command || "(not recorded: started from Python or a script)"),
    ` · ${s.at || "?"}, from step ${s.from_step ?? "?"}`));
}

function runSection() {
  const run = data.run;
  const progress = run.steps ? el("progress", { max: run.steps, value: Math.max(0, run.last_step || 0) }) : null;
  const status = run.finished === true ? "finished" : "not finished (running, stopped or crashed)";
  const evals = run.evals.map(([s, a]) => `${fmt(a)} at step ${s}`).join(", ");
  const facts = [
    ["run folder", run.path],
    ["run id", run.run_id || "unknown (no run.json)"],
    ["status", [status, " · ", `step ${run.last_step ?? "–"} of ${run.steps ?? "?"}`, " ", progress]],
    ["command", commands(run.starts)],
    ["model", run.model || "unknown"],
    ["data", Object.entries(run.data).map(([k, v]) => `${k} ${JSON.stringify(v)}`).join("  ")],
    ["wall time", run.summary && typeof run.summary.wall_time_s === "number"
      ? `${duration(run.summary.wall_time_s)} (the last start, to its end)` : "– (the run has not finished)"],
    ["time in steps", `${duration(run.step_seconds)} (timings.jsonl: sampling and updates, evaluation not included)`],
    ["last line logged", run.last_write ? new Date(run.last_write * 1000).toLocaleString() : "–"],
    ["held-out accuracy", evals || "no evaluation logged"],
    ["checkpoints", run.checkpoints.join(", ") || "none"],
    ["report built", data.built],
  ];
  const dl = el("dl", {}, facts.map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  const settings = Object.entries(run.settings);
  const table = el("table", { class: "settings" },
    settings.map(([k, v]) => el("tr", {}, el("td", {}, k), el("td", {}, JSON.stringify(v)))));
  const last = run.last_metrics ? el("table", { class: "settings", id: "last-metrics" },
    Object.entries(run.last_metrics).map(([k, v]) => el("tr", {}, el("td", {}, k), el("td", { "data-key": k }, fmt(v, 6))))) : null;
  return section("run", "Run", dl,
    el("details", {}, el("summary", {}, `settings (run.json), as flags: ${settings.length}`), table),
    last ? el("details", {}, el("summary", {}, `metrics of the last step (${run.last_metrics.step})`), last) : null);
}

// --- curves -----------------------------------------------------------------------------------------------
function curvesSection() {
  const { main, grid, grid_keys: keys, tables, rest, pass_at_k: passAtK } = data.charts;
  if (!main) return section("curves", "Curves", note("No metrics logged yet."));
  const more = [];
  if (passAtK) more.push(el("img", { src: passAtK, alt: "held-out pass@k per evaluation", class: "pass-at-k" }));
  if (grid) {
    more.push(el("details", {}, el("summary", {}, `the other ${keys.length} logged metrics: ${keys.join(", ")}`),
      el("img", { src: grid, alt: keys.join(", "), class: "main-chart" })));
  }
  const names = Object.keys(tables);
  if (names.length) {
    const steps = [...new Set(names.flatMap(k => tables[k].map(([s]) => s)))].sort((a, b) => a - b);
    const table = el("table", { class: "settings", id: "metric-values" },
      el("tr", {}, el("th", {}, "metric"), steps.map(s => el("th", {}, `step ${s}`))),
      names.map(k => {
        const values = Object.fromEntries(tables[k]);
        return el("tr", {}, el("td", {}, k), steps.map(s => el("td", { class: "num" }, fmt(values[s], 4))));
      }));
    more.push(el("details", {}, el("summary", {}, `${names.length} ${names.length > 1 ? "metrics" : "metric"} with fewer than 10 values, as a table: ${names.join(", ")}`), table));
  }
  if (rest.length) { // the metrics past the panels: one line each
    const table = el("table", { class: "settings", id: "metric-rest" },
      el("tr", {}, ["metric", "values", "lowest", "highest", "last step", "last value"].map(h => el("th", {}, h))),
      rest.map(([k, n, low, high, step, last]) => el("tr", {}, el("td", {}, k),
        [n, fmt(low, 4), fmt(high, 4), step, fmt(last, 4)].map(v => el("td", { class: "num" }, v)))));
    more.push(el("details", {}, el("summary", {}, `${rest.length} more ${rest.length > 1 ? "metrics" : "metric"}, not drawn: their range and last value`), table));
  }
  return section("curves", "Curves", el("img", { src: main, alt: "reward, held-out accuracy and KL", class: "main-chart" }), more);
}

// --- rollouts ---------------------------------------------------------------------------------------------
const view = { step: 0, groups: "all", rows: "all", component: "", query: "", limit: GROUPS_PAGE };
const STEPS = data.rollouts.steps;

function rowPasses(row) {
  if (view.rows === "right" && !isRight(row)) return false;
  if (view.rows === "wrong" && isRight(row)) return false;
  if (view.rows === "truncated" && !row[4]) return false;
  if (view.component) {
    const [name, value] = view.component.split("\u0000");
    if (String(row[5][COMPONENTS.indexOf(name)]) !== value) return false;
  }
  return true;
}

function groupPasses(group) {
  const right = group.rows.filter(isRight).length;
  switch (view.groups) {
    case "zero": return group.zero_spread;
    case "some": return right > 0;
    case "none": return right === 0;
    case "all-right": return right === group.rows.length;
    default: return true;
  }
}

function turnsView(turns) {
  return el("ol", { class: "turns" }, turns.map(turn => {
    const call = turn.call;
    const parts = [el("pre", {}, turn.text)];
    if (call) {
      const head = el("div", { class: "call" }, el("b", {}, call.name ?? "(no tool)"), " ", el("code", {}, call.arguments));
      if (call.error) head.append(" ", el("span", { class: "badge bad" }, `error: ${call.error}`));
      parts.push(head);
      if (call.text) parts.push(el("pre", { class: "tool-text" }, call.text));
      for (const crop of call.images) {
        const entry = { t: crop.t, s: null, ref: `crop [${(crop.crop || []).map(v => fmt(v, 1)).join(", ")}]`, size: crop.size, why: crop.why };
        parts.push(thumb(entry, []));
      }
    }
    return el("li", {}, parts);
  }));
}

function groupCard(step, group) {
  const right = group.rows.filter(isRight).length;
  const reference = targetBoxes(group.target);
  const layers = [{ boxes: reference, colour: "#2ca02c", dashed: true, label: "reference" },
    ...group.rows.map((row, i) => ({ boxes: row[6] ? row[6].boxes : [], colour: PALETTE[i % PALETTE.length], label: `row ${i}` }))];
  const badges = [
    group.zero_spread ? el("span", { class: "badge zero", title: "every reward equal: every advantage 0" }, "zero reward spread") : null,
    ACCURACY >= 0 ? el("span", { class: `badge ${right ? "ok" : "bad"}` }, `${right}/${group.rows.length} right`) : null,
  ];
  const head = el("header", {}, el("b", {}, `group ${group.group}`), group.id ? ` · ${group.id}` : "", " ", badges);
  const sample = el("div", { class: "sample" },
    el("div", { class: "images" }, group.images.length ? group.images.map(e => thumb(e, layers)) : note("no image")),
    el("div", { class: "texts" },
      el("div", { class: "label" }, "prompt"), el("pre", {}, group.prompt === null ? "(not kept by this run)" : text(group.prompt)),
      el("div", { class: "label" }, "target"), targetView(group.target)));
  const heads = ["#", "completion", "reward", ...COMPONENTS, "advantage", "length", "truncated"];
  const rows = group.rows.map((row, i) => {
    const [t, reward, adv, length, truncated, comps, extras] = row;
    const swatch = extras && extras.boxes && extras.boxes.length ? el("span", { class: "swatch", style: `background:${PALETTE[i % PALETTE.length]}` }) : null;
    const completion = el("td", { class: "completion" }, el("pre", {}, text(t)),
      extras && extras.turns ? el("details", {}, el("summary", {}, `${extras.turns.length} turns`), turnsView(extras.turns)) : null);
    return el("tr", { class: [isRight(row) ? "right" : "wrong", rowPasses(row) ? "" : "filtered"].join(" "), "data-row": i },
      el("td", {}, i, swatch), completion, el("td", { class: "num" }, fmt(reward)),
      comps.map(c => el("td", { class: "num" }, fmt(c))), el("td", { class: "num" }, fmt(adv)),
      el("td", { class: "num" }, length ?? "–"), el("td", {}, truncated ? "yes" : ""));
  });
  const table = el("table", { class: "rows" }, el("tr", {}, heads.map(h => el("th", {}, h))), rows);
  return el("article", { class: `group${group.zero_spread ? " zero-spread" : ""}`, id: `g-${step}-${group.group}` }, head, sample, table);
}

function targetView(target) {
  if (!target) return el("pre", {}, "(not kept by this run)");
  return el("dl", { class: "target" }, Object.entries(target).map(([k, v]) =>
    [el("dt", {}, k), el("dd", {}, typeof v === "string" ? v : JSON.stringify(v))]));
}

function renderStep() {
  const box = document.getElementById("groups");
  const step = STEPS[view.step];
  box.replaceChildren();
  if (!step) return;
  // NOTE: a step of B = 256 prompts is 256 cards and their images: drawn GROUPS_PAGE at a time
  const passing = step.groups.filter(group => groupPasses(group) && group.rows.some(rowPasses));
  const shown = passing.slice(0, view.limit);
  box.append(...shown.map(group => groupCard(step.step, group)));
  if (passing.length > shown.length) {
    const more = Math.min(GROUPS_PAGE, passing.length - shown.length);
    box.append(el("button", { onclick: () => { view.limit += GROUPS_PAGE; renderStep(); } }, `show ${more} more of ${passing.length - shown.length}`));
  }
  document.getElementById("step-select").value = view.step;
  const of = passing.length < step.groups.length ? ` (${passing.length} pass the filters)` : "";
  document.getElementById("shown").textContent = `step ${step.step}: ${shown.length} of ${step.groups.length} groups shown${of}`;
  if (!shown.length) box.append(note("No group of this step passes the filters."));
}

function goTo(index) {
  view.step = Math.max(0, Math.min(STEPS.length - 1, index));
  view.limit = GROUPS_PAGE;
  renderStep();
}

function search(query) {
  const results = document.getElementById("results");
  results.replaceChildren();
  query = query.trim().toLowerCase();
  if (query.length < 2) return;
  const hits = [];
  STEPS.forEach((step, s) => step.groups.forEach(group => {
    const where = [text(group.prompt), JSON.stringify(group.target || {})].join("\n").toLowerCase();
    const rows = group.rows.map((row, i) => [i, text(row[0])]).filter(([, t]) => t.toLowerCase().includes(query));
    if (where.includes(query)) hits.push([s, group, null, text(group.prompt)]);
    for (const [i, t] of rows) hits.push([s, group, i, t]);
  }));
  results.append(el("p", {}, `${hits.length} matches${hits.length > 200 ? " (the first 200 listed)" : ""}`));
  results.append(el("ul", {}, hits.slice(0, 200).map(([s, group, i, t]) => {
    const where = `step ${STEPS[s].step} · group ${group.group}${i === null ? " · prompt/target" : ` · row ${i}`}`;
    const at = t.toLowerCase().indexOf(query);
    const snippet = at < 0 ? "" : t.slice(Math.max(0, at - 30), at + query.length + 30).replace(/\s+/g, " ");
    return el("li", {}, el("a", { href: "#", onclick: e => { e.preventDefault(); reveal(s, group.group); } }, where), " ", el("span", { class: "snippet" }, snippet));
  })));
}

function reveal(stepIndex, groupNumber) {
  Object.assign(view, { groups: "all", rows: "all", component: "" });
  for (const id of ["group-filter", "row-filter", "component-filter"]) document.getElementById(id).selectedIndex = 0;
  view.step = stepIndex;
  view.limit = STEPS[stepIndex].groups.findIndex(g => g.group === groupNumber) + GROUPS_PAGE;
  renderStep();
  const card = document.getElementById(`g-${STEPS[stepIndex].step}-${groupNumber}`);
  if (card) {
    card.scrollIntoView({ block: "start" });
    card.classList.add("flash");
  }
}

function componentOptions() {
  const options = [el("option", { value: "" }, "any component value")];
  COMPONENTS.forEach((name, c) => {
    const values = new Set();
    for (const step of STEPS) for (const g of step.groups) for (const row of g.rows) values.add(String(row[5][c]));
    if (values.size > 8) return; // a continuous reward: no short list of values to pick from
    for (const v of [...values].sort()) options.push(el("option", { value: `${name}\u0000${v}` }, `${name} = ${v}`));
  });
  return options;
}

function rolloutsSection() {
  const r = data.rollouts;
  if (!STEPS.length) {
    return section("rollouts", "Rollouts", note(r.logged ? "No logged step could be read." : "No rollout logged (rollouts.jsonl absent or empty; --log-completions-every 0 keeps none)."));
  }
  const stepSelect = el("select", { id: "step-select", onchange: e => goTo(+e.target.value) },
    STEPS.map((s, i) => el("option", { value: i }, `step ${s.step}`)));
  const filter = (id, key, options) => el("select", { id, onchange: e => { view[key] = e.target.value; renderStep(); } },
    options.map(([v, label]) => el("option", { value: v }, label)));
  const controls = el("div", { class: "controls" },
    el("button", { onclick: () => goTo(view.step - 1), title: "previous step (← or k)" }, "◀"), stepSelect,
    el("button", { onclick: () => goTo(view.step + 1), title: "next step (→ or j)" }, "▶"),
    filter("group-filter", "groups", [["all", "all groups"], ["zero", "zero reward spread"], ["some", "with a right completion"],
      ["none", "with no right completion"], ["all-right", "all right"]]),
    filter("row-filter", "rows", [["all", "all rows"], ["right", "right rows"], ["wrong", "wrong rows"], ["truncated", "truncated rows"]]),
    el("select", { id: "component-filter", onchange: e => { view.component = e.target.value; renderStep(); } }, componentOptions()),
    el("input", { type: "search", id: "search", placeholder: "search every step's texts", oninput: e => search(e.target.value) }),
    el("span", { id: "shown" }));
  const left = r.left_out.length ? note(`${r.logged} steps logged; ${STEPS.length} are in this report, spread over the run; left out: steps ${r.left_out.join(", ")}.`) : null;
  const kept = STEPS.some(s => s.groups.some(g => g.images.some(i => "t" in i)));
  const none = kept ? null : note("This run kept no thumbnails (its rollouts.jsonl names none: a run from before thumbs/ was written): each image is a placeholder with the name rollouts.jsonl gives it.");
  const legend = note(`"Right" means the accuracy reward (${data.accuracy ?? "none"}) is at least 1. Rows the filters exclude are hidden; a green dashed box is the reference, coloured ones each row's parsed boxes.`);
  return section("rollouts", "Rollouts", left, none, legend, controls, el("div", { id: "results" }), el("div", { id: "groups" }));
}

// --- before and after: the held-out samples at the first and the latest evaluation ------------------------
function pairKind(pair) {
  if (!pair.before || !pair.after) return "unpaired";
  if (pair.before.correct) return pair.after.correct ? "still right" : "broken";
  return pair.after.correct ? "fixed" : "still wrong";
}

function answerView(answer, step, colour) {
  if (!answer) return el("div", { class: "answer" }, note(`not evaluated at step ${step}`));
  const mark = answer.correct ? el("span", { class: "badge ok" }, "✓ right") : el("span", { class: "badge bad" }, "✗ wrong");
  const parts = Object.entries(answer.rewards).map(([k, v]) => `${k} ${fmt(v)}`).join(" · ");
  return el("div", { class: "answer" }, el("div", { class: "label" }, `step ${step} `, mark, answer.boxes && answer.boxes.length ? el("span", { class: "swatch", style: `background:${colour}` }) : null),
    el("pre", {}, text(answer.completion)),
    el("div", { class: "small" }, `reward ${fmt(answer.reward)} (${parts}) · ${answer.length ?? "–"} tokens${answer.truncated ? " · truncated" : ""}`),
    answer.turns ? el("details", {}, el("summary", {}, `${answer.turns.length} turns`), turnsView(answer.turns)) : null);
}

function evalSection() {
  const e = data.evals;
  if (!e) return section("before-after", "Before and after", note("This run kept no held-out samples (no eval_samples.jsonl: a run from an earlier version, or one without a held-out set). The held-out accuracy per evaluation is in the curves."));
  if (!e.pairs.length) return section("before-after", "Before and after", note("eval_samples.jsonl holds no readable sample yet."));
  const kinds = ["fixed", "broken", "still wrong", "still right", "unpaired"];
  const counts = Object.fromEntries(kinds.map(k => [k, e.pairs.filter(p => pairKind(p) === k).length]));
  let chosen = "all", limit = PAGE;
  const box = el("div", { id: "pairs" });
  function render() {
    const pairs = e.pairs.filter(p => chosen === "all" || pairKind(p) === chosen);
    box.replaceChildren(...pairs.slice(0, limit).map(pair => {
      const layers = [{ boxes: targetBoxes(pair.target), colour: "#2ca02c", dashed: true, label: "reference" },
        { boxes: pair.before?.boxes, colour: PALETTE[1], label: `step ${e.first}` }, { boxes: pair.after?.boxes, colour: PALETTE[0], label: `step ${e.last}` }];
      return el("article", { class: `pair ${pairKind(pair).replace(" ", "-")}` },
        el("header", {}, el("b", {}, `#${pair.index}`), pair.id ? ` · ${pair.id}` : "", " ", el("span", { class: "badge" }, pairKind(pair))),
        el("div", { class: "sample" }, el("div", { class: "images" }, pair.images.map(i => thumb(i, layers))),
          el("div", { class: "texts" }, el("details", {}, el("summary", {}, "prompt"), el("pre", {}, text(pair.prompt))),
            el("div", { class: "label" }, "target"), targetView(pair.target))),
        el("div", { class: "answers" }, answerView(pair.before, e.first, PALETTE[1]), answerView(pair.after, e.last, PALETTE[0])));
    }));
    if (pairs.length > limit) box.append(el("button", { onclick: () => { limit += PAGE; render(); } }, `show ${Math.min(PAGE, pairs.length - limit)} more of ${pairs.length - limit}`));
    document.body.dataset.pairs = box.querySelectorAll(".pair").length;
  }
  const buttons = el("div", { class: "controls" }, ["all", ...kinds].filter(k => k === "all" || counts[k]).map(k =>
    el("button", { class: k === "all" ? "on" : "", onclick: ev => {
      chosen = k; limit = PAGE;
      for (const b of buttons.children) b.classList.toggle("on", b === ev.target);
      render();
    } }, `${k} (${k === "all" ? e.pairs.length : counts[k]})`)));
  render();
  const lead = e.first === e.last ? `Only one evaluation so far (step ${e.first}): its greedy answers.`
    : `The greedy answer to each held-out sample at the first evaluation (step ${e.first}) and the latest (step ${e.last}).`;
  return section("before-after", "Before and after", note(lead), buttons, box);
}

// --- the page ---------------------------------------------------------------------------------------------
function problemsView() {
  if (!data.problems.length) return null;
  return el("details", { class: "problems", open: true }, el("summary", {}, `${data.problems.length} things could not be read from the run folder`),
    el("ul", {}, data.problems.map(p => el("li", {}, p))));
}

// NOTE: a browser without a font for a script draws each of its characters as the same empty box (Debian's
// Chromium without fonts-noto-cjk: every 通过 / 不通过 / 理由). The characters past U+2E7F of the first texts,
// drawn on a canvas in the page's font, are compared with a code point no font has (U+10FFFD).
function missingGlyphs() {
  const chars = new Set();
  for (const t of TEXTS) {
    for (const c of t) if (c.codePointAt(0) > 0x2e7f && chars.size < 200) chars.add(c);
    if (chars.size >= 200) break;
  }
  if (!chars.size) return [];
  const canvas = el("canvas", { width: 32, height: 32 });
  const ctx = canvas.getContext("2d", { willReadFrequently: true });
  ctx.font = `24px ${getComputedStyle(document.body).fontFamily}`;
  const draw = c => { ctx.clearRect(0, 0, 32, 32); ctx.fillText(c, 2, 26); return ctx.getImageData(0, 0, 32, 32).data.join(); };
  const none = draw("\u{10FFFD}");
  return [...chars].filter(c => draw(c) === none);
}

function fontsNote(missing) {
  if (!missing.length) return null;
  return el("p", { class: "problems", id: "missing-glyphs" }, `This browser has no font for ${missing.length} characters of this report (${missing.slice(0, 12).join(" ")}${missing.length > 12 ? " …" : ""}): they show as empty boxes. Install a font that has them (on Debian or Ubuntu for Chinese, Japanese and Korean: apt-get install fonts-noto-cjk) and reload.`);
}

function render() {
  const run = data.run;
  const status = run.finished === true ? "finished" : `step ${run.last_step ?? "–"} of ${run.steps ?? "?"}`;
  const missing = missingGlyphs();
  document.body.dataset.missingGlyphs = missing.length;
  document.getElementById("report").replaceChildren(
    el("header", { class: "top" }, el("h1", {}, `GRPO run ${run.folder}`), el("span", { class: "status" }, status),
      el("nav", {}, ["run", "curves", "rollouts", "before-after"].map(id => el("a", { href: `#${id}` }, id.replace("-", " "))))),
    el("p", { class: "private" }, "This file holds every start's command line, absolute paths, the prompts, targets and completions, and thumbnails of the images: share it as you would share the data."),
    ...[fontsNote(missing), problemsView(), runSection(), curvesSection(), rolloutsSection(), evalSection()].filter(Boolean));
  if (STEPS.length) goTo(STEPS.length - 1); // the latest step first
  // NOTE: the browser looked for report.html#rollouts before the sections existed
  if (location.hash) document.getElementById(location.hash.slice(1))?.scrollIntoView();
  addEventListener("keydown", e => {
    if (["INPUT", "SELECT", "TEXTAREA"].includes(document.activeElement.tagName)) return;
    if (e.key === "Escape") document.getElementById("lightbox")?.remove();
    if (e.key === "ArrowLeft" || e.key === "k") goTo(view.step - 1);
    if (e.key === "ArrowRight" || e.key === "j") goTo(view.step + 1);
  });
}

async function settle() {
  // the counts a headless browser reads from the DOM once every image has loaded or failed
  const images = [...document.images];
  await Promise.all(images.map(img => img.complete ? null : new Promise(done => {
    img.addEventListener("load", done);
    img.addEventListener("error", done);
  })));
  const loaded = images.filter(img => img.complete && img.naturalWidth > 0).length;
  Object.assign(document.body.dataset, {
    groups: document.querySelectorAll("article.group").length,
    imagesLoaded: loaded,
    imagesBroken: images.length - loaded,
    errors: window.reportErrors.length,
    settledMs: performance.now().toFixed(0), // every image decoded
    ready: "1",
  });
}

render();
document.body.dataset.renderMs = performance.now().toFixed(0);
settle();
