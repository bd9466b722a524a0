// PowerFusion GIR visualiser: reads the JSON in #pf-data (docs/viz.md), lays graphs out with
// dagre (shipped alongside), draws SVG. State lives in the URL hash: #view=sg0&step=3&node=5.
(function () {
  "use strict";
  const DATA = unpack(JSON.parse(document.getElementById("pf-data").textContent));
  const SVGNS = "http://www.w3.org/2000/svg";
  const KIND_COLOUR = {elementwise: "#8fd19e", reduce: "#f4a261", broadcast: "#e9c46a", move: "#9cc3ee",
                       library: "#f28482", subgraph: "#cfe3ff", io: "#e6e6e6", cluster: "#dfe7f3"};
  const SCOPE_COLOUR = {lane: "#eeeeee", warp: "#d7ccff", block: "#b38ae8", device: "#e76f51"};
  const BIG = 250;   // above this many nodes, clusters start collapsed
  const $ = (id) => document.getElementById(id);
  const state = {view: null, step: 0, node: null, search: "", collapsed: {}, labels: true};
  const layoutCache = new Map();
  let view = {scale: 1, x: 0, y: 0};
  let currentClusters = [];

  // html.py `pack` stores each subgraph's gOperators, buffers and interfaces once, and no edges
  function unpack(data) {
    if (!data.packed) return data;
    for (const sg of data.subgraphs) {
      const T = sg.tables;
      for (const st of sg.stages) {
        const g = st.gir;
        const [inputs, outputs, constants, parallel] = T.io[g.io];
        delete g.io;
        Object.assign(g, {inputs, outputs, constants, parallel});
        g.ops = g.ops.map(([ref, kernel, cluster], index) => Object.assign({}, T.ops[ref],
          {index, kernel, cluster: cluster !== undefined ? cluster : (kernel === null ? null : "kernel " + kernel)}));
        g.buffers = g.buffers.map((ref) => T.buffers[ref]);
        g.edges = dataflowEdges(g);
      }
      delete sg.tables;
    }
    delete data.packed;
    return data;
  }
  // gir_json.dataflow_edges: a reader is fed by the writers of a buffer since it was last read
  function dataflowEdges(g) {
    const outside = new Set(g.inputs.concat(g.constants));
    const edges = [], pending = new Map(), readSince = new Map(), lastData = new Map();
    const edge = (a, b, s) => edges.push({source: a, target: b, buffer: s.buffer, label: s.label});
    g.ops.forEach((op, k) => {
      for (const s of op.inputs) {
        if (pending.has(s.buffer)) for (const w of pending.get(s.buffer)) edge(w, k, s);
        else if (outside.has(s.buffer)) edge("in:" + s.buffer, k, s);
        readSince.set(s.buffer, true);
      }
      for (const s of op.outputs) {
        if (!readSince.has(s.buffer) || readSince.get(s.buffer)) pending.set(s.buffer, []);
        const p = pending.get(s.buffer);
        if (!p.includes(k)) p.push(k);
        readSince.set(s.buffer, false);
        if (op.kind !== "sync") lastData.set(s.buffer, p.slice());
      }
    });
    for (const name of g.outputs) {
      for (const w of lastData.get(name) || []) edge(w, "out:" + name, g.ops[w].outputs.find((s) => s.buffer === name));
    }
    return edges;
  }

  function el(tag, attrs, parent) {
    const e = document.createElementNS(SVGNS, tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function html(tag, text, parent, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = text;
    if (cls) e.className = cls;
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmtBytes(b) {
    if (b === null || b === undefined) return "-";
    if (b >= 1 << 20) return (b / (1 << 20)).toFixed(2) + " MiB";
    if (b >= 1 << 10) return (b / (1 << 10)).toFixed(1) + " KiB";
    return b + " B";
  }
  const subgraphs = DATA.subgraphs || [];
  const subByName = new Map(subgraphs.map((s) => [s.name, s]));

  // ---- URL hash <-> state --------------------------------------------------------------
  function readHash() {
    const p = new URLSearchParams(location.hash.replace(/^#/, ""));
    const def = DATA.partition ? "partition" : (subgraphs[0] ? subgraphs[0].name : "partition");
    state.view = p.get("view") || def;
    if (state.view !== "partition" && !subByName.has(state.view)) state.view = def;
    const sg = subByName.get(state.view);
    const n = sg ? sg.stages.length : 0;
    let step = p.has("step") ? parseInt(p.get("step"), 10) : (n ? n - 1 : 0);
    if (isNaN(step)) step = 0;
    state.step = Math.max(0, Math.min(step, Math.max(n - 1, 0)));
    state.node = p.get("node");
    state.search = p.get("q") || "";
  }
  function writeHash() {
    const p = new URLSearchParams();
    p.set("view", state.view);
    if (state.view !== "partition") p.set("step", String(state.step));
    if (state.node !== null && state.node !== undefined) p.set("node", state.node);
    if (state.search) p.set("q", state.search);
    const h = "#" + p.toString();
    if (location.protocol === "about:") return;   // a srcdoc iframe (notebooks) has no URL to keep state in
    if (location.hash !== h) history.replaceState(null, "", h);
  }
  function go(changes) {
    Object.assign(state, changes);
    writeHash();
    render();
  }

  // ---- the graph to draw, as {nodes, edges} with clusters ----------------------------------
  function partitionGraph() {
    const P = DATA.partition;
    const nodes = P.nodes.map((n) => ({id: n.id, label: n.op_type, sub: n.name, kind: n.kind,
      cluster: n.kind === "subgraph" ? n.step : null, data: n, search: [n.name, n.op_type, n.step].concat(n.tensors)}));
    const seen = new Set(nodes.map((n) => n.id));
    const edges = [];
    for (const e of P.edges) {
      for (const end of [e.source, e.target]) {
        if (!seen.has(end)) {
          seen.add(end);
          const name = end.slice(end.indexOf(":") + 1);
          nodes.push({id: end, label: name, sub: end.startsWith("in:") ? "input" : "output", kind: "io",
                      cluster: null, data: {io: end, tensor: name}, search: [name]});
        }
      }
      edges.push({source: e.source, target: e.target,
                  label: e.shape ? "[" + e.shape.join("\u00d7") + "]" : "", cls: "", search: [e.tensor], data: e});
    }
    return {nodes, edges};
  }
  function girGraph(sg, stage) {
    const G = stage.gir;
    const added = new Set(stage.added || []);
    const next = sg.stages[state.step + 1];   // what the next rule will replace, outlined in orange
    const doomed = new Set(next && next.kind === "rule" ? next.changed : []);
    const nodes = G.ops.map((o) => ({id: String(o.index), label: o.label,
      sub: (o.origin ? o.origin + " " : "") + "#" + o.uid, kind: o.kind, scope: o.scope, cluster: o.cluster,
      added: added.has(o.uid), doomed: doomed.has(o.uid), data: o,
      search: [o.label, o.origin, String(o.uid)].concat(o.inputs.map((s) => s.buffer), o.outputs.map((s) => s.buffer))}));
    const ids = new Set(nodes.map((n) => n.id));
    const edges = [];
    for (const e of G.edges) {
      for (const end of [e.source, e.target]) {
        const id = String(end);
        if (!ids.has(id)) {
          ids.add(id);
          const name = id.slice(id.indexOf(":") + 1);
          nodes.push({id, label: name, sub: id.startsWith("in:") ? "input" : "output", kind: "io", cluster: null,
                      data: {io: id, buffer: name}, search: [name]});
        }
      }
      edges.push({source: String(e.source), target: String(e.target), label: e.label,
                  cls: e.label.split(" ")[0], search: [e.buffer], data: e});
    }
    return {nodes, edges};
  }

  // collapse: members of a collapsed cluster become one node; edges re-routed and deduplicated
  function collapse(g, key) {
    const clusters = new Map();
    for (const n of g.nodes) if (n.cluster) clusters.set(n.cluster, (clusters.get(n.cluster) || 0) + 1);
    if (!(key in state.collapsed)) state.collapsed[key] = g.nodes.length > BIG && clusters.size > 1 ? new Set(clusters.keys()) : new Set();
    const closed = state.collapsed[key];
    currentClusters = [...clusters.keys()];
    const owner = new Map();
    const nodes = [];
    for (const n of g.nodes) {
      if (n.cluster && closed.has(n.cluster)) {
        const cid = "cluster:" + n.cluster;
        owner.set(n.id, cid);
        if (!nodes.some((m) => m.id === cid)) {
          nodes.push({id: cid, label: n.cluster, sub: clusters.get(n.cluster) + " nodes (collapsed)",
                      kind: "cluster", cluster: null, collapsedCluster: n.cluster, data: {cluster: n.cluster}, search: []});
        }
        nodes.find((m) => m.id === cid).search.push(...n.search);
      } else nodes.push(n);
    }
    const edges = [], seen = new Set();
    for (const e of g.edges) {
      const s = owner.get(e.source) || e.source, t = owner.get(e.target) || e.target;
      const k = s + "\u0000" + t + "\u0000" + e.label;
      if (s === t || seen.has(k)) continue;
      seen.add(k);
      edges.push(Object.assign({}, e, {source: s, target: t}));
    }
    return {nodes, edges, clusters: [...clusters.keys()].filter((c) => !closed.has(c))};
  }

  function layout(g, cacheKey) {
    if (layoutCache.has(cacheKey)) return layoutCache.get(cacheKey);
    const t0 = performance.now();
    const d = new dagre.graphlib.Graph({compound: true, multigraph: true});
    d.setGraph({rankdir: "TB", nodesep: 24, ranksep: 36, edgesep: 8, marginx: 20, marginy: 20});
    d.setDefaultEdgeLabel(() => ({}));
    for (const c of g.clusters) d.setNode("cl:" + c, {label: c, clusterLabelPos: "top"});
    for (const n of g.nodes) {
      const w = Math.max(70, 7 * Math.max(n.label.length, (n.sub || "").length * 0.85) + 18);
      d.setNode(n.id, {width: w, height: n.kind === "sync" ? 30 : 38});
      if (n.cluster && g.clusters.includes(n.cluster)) d.setParent(n.id, "cl:" + n.cluster);
    }
    g.edges.forEach((e, k) => {
      const lbl = state.labels ? e.label : "";
      d.setEdge(e.source, e.target, {width: lbl ? lbl.length * 5.5 : 0, height: lbl ? 12 : 0, labelpos: "c"}, "e" + k);
    });
    dagre.layout(d);
    document.body.dataset.layoutMs = String(Math.round(performance.now() - t0));
    layoutCache.set(cacheKey, d);
    return d;
  }

  // ---- drawing -------------------------------------------------------------------------
  function nodeFill(n) {
    if (n.kind === "sync") return SCOPE_COLOUR[n.scope] || "#ccc";
    return KIND_COLOUR[n.kind] || "#ddd";
  }
  function draw(g, d) {
    const svg = $("graph");
    svg.innerHTML = "";
    const defs = el("defs", {}, svg);
    const m = el("marker", {id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7,
                            orient: "auto-start-reverse"}, defs);
    el("path", {d: "M0,0 L10,5 L0,10 z", fill: "#777"}, m);
    const root = el("g", {id: "root"}, svg);
    for (const c of g.clusters) {
      const b = d.node("cl:" + c);
      if (!b) continue;
      const grp = el("g", {class: "cluster"}, root);
      el("rect", {x: b.x - b.width / 2, y: b.y - b.height / 2, width: b.width, height: b.height, rx: 6}, grp);
      const t = el("text", {x: b.x - b.width / 2 + 6, y: b.y - b.height / 2 + 12}, grp);
      t.textContent = c + "  [collapse]";
      t.addEventListener("click", (ev) => { ev.stopPropagation(); toggleCluster(c); });
    }
    g.edges.forEach((e, k) => {
      const de = d.edge({v: e.source, w: e.target, name: "e" + k});
      if (!de) return;
      const grp = el("g", {class: "edge " + (e.cls || "")}, root);
      grp.dataset.source = e.source; grp.dataset.target = e.target;
      const pts = de.points;
      el("path", {d: "M" + pts.map((p) => p.x + "," + p.y).join(" L"), "marker-end": "url(#arrow)"}, grp);
      if (state.labels && e.label && de.x !== undefined) {
        const t = el("text", {x: de.x, y: de.y + 3, "text-anchor": "middle"}, grp);
        t.textContent = e.label;
      }
    });
    for (const n of g.nodes) {
      const b = d.node(n.id);
      const cls = ["node"];
      if (n.added) cls.push("added");
      if (n.doomed) cls.push("doomed");
      if (state.node === n.id) cls.push("selected");
      const grp = el("g", {class: cls.join(" "), transform: "translate(" + b.x + "," + b.y + ")"}, root);
      grp.dataset.id = n.id;
      if (n.kind === "io") el("ellipse", {rx: b.width / 2, ry: b.height / 2, fill: nodeFill(n)}, grp);
      else el("rect", {x: -b.width / 2, y: -b.height / 2, width: b.width, height: b.height, rx: n.kind === "sync" ? 12 : 4,
                       fill: nodeFill(n), "stroke-width": n.scope === "device" ? 3 : 1}, grp);
      const t1 = el("text", {y: n.sub ? -3 : 4, "text-anchor": "middle", "font-weight": 600}, grp);
      t1.textContent = n.label;
      if (n.sub) { const t2 = el("text", {y: 11, "text-anchor": "middle", fill: "#444"}, grp); t2.textContent = n.sub; }
      grp.addEventListener("click", (ev) => {
        ev.stopPropagation();
        if (n.collapsedCluster) { toggleCluster(n.collapsedCluster); return; }
        go({node: n.id});
      });
    }
    applyTransform();
    return root;
  }
  function toggleCluster(c) {
    const closed = state.collapsed[currentKey()];
    if (closed.has(c)) closed.delete(c); else closed.add(c);
    render();
  }
  function applyTransform() {
    const root = $("root");
    if (root) root.setAttribute("transform", "translate(" + view.x + "," + view.y + ") scale(" + view.scale + ")");
  }
  // whole: the entire graph in the window; otherwise fit the width (readable) and start at the top
  function fit(d, whole) {
    const G = d.graph(), svg = $("graph");
    const w = svg.clientWidth || 800, h = svg.clientHeight || 600;
    const byWidth = Math.min(w / (G.width || 1), 1.2);
    const s = whole ? Math.min(byWidth, h / (G.height || 1)) : byWidth;
    view = {scale: s, x: (w - G.width * s) / 2, y: G.height * s < h ? (h - G.height * s) / 2 : 0};
    applyTransform();
  }
  function centreOn(d, id) {
    const b = d.node(id), svg = $("graph");
    if (!b) return;
    view.x = (svg.clientWidth || 800) / 2 - b.x * view.scale;
    view.y = (svg.clientHeight || 600) / 2 - b.y * view.scale;
    applyTransform();
  }

  // ---- panels --------------------------------------------------------------------------
  function currentKey() { return state.view === "partition" ? "partition" : state.view + "/" + state.step; }
  function sidebar() {
    const list = $("views");
    list.innerHTML = "";
    if (DATA.partition) {
      const it = html("div", "Partition (" + DATA.partition.nodes.length + " ONNX nodes)", list, "item");
      if (state.view === "partition") it.classList.add("current");
      it.onclick = () => go({view: "partition", node: null});
    }
    for (const sg of subgraphs) {
      const k = sg.kernels;
      const txt = sg.name + "  " + (sg.error ? (sg.failed_at === "timeout" ? "timed out" : "failed at " + sg.failed_at) :
        k.before + "\u2192" + k.after + " kernels, " + sg.trace_steps + " steps");
      const it = html("div", txt, list, "item" + (sg.error ? " error" : ""));
      if (state.view === sg.name) it.classList.add("current");
      it.title = sg.onnx_nodes.join(", ");
      it.onclick = () => go({view: sg.name, step: Math.max(sg.stages.length - 1, 0), node: null});
    }
  }
  function stepper(sg) {
    const bar = $("stepper");
    bar.innerHTML = "";
    if (!sg) { html("span", "partition of " + DATA.model + " for " + DATA.target, bar, "muted"); legend(bar, true); return; }
    const n = sg.stages.length;
    const prev = html("button", "\u25c0 back", bar); prev.id = "prev"; prev.disabled = state.step <= 0;
    prev.onclick = () => go({step: state.step - 1, node: null});
    const range = html("input", null, bar); range.type = "range"; range.min = 0; range.max = Math.max(n - 1, 0);
    range.value = state.step; range.oninput = () => go({step: parseInt(range.value, 10), node: null});
    const next = html("button", "forward \u25b6", bar); next.id = "next"; next.disabled = state.step >= n - 1;
    next.onclick = () => go({step: state.step + 1, node: null});
    const stage = sg.stages[state.step];
    const lab = html("span", n ? (state.step + 1) + "/" + n + ": " + stage.label : "no stages", bar);
    lab.id = "stage-label";
    if (stage && stage.kind === "rule")
      html("span", "replaced #" + stage.changed.join(", #") + (stage.added.length ? "; new #" + stage.added.join(", #") + " (red dashes)" : ""), bar, "muted");
    const coming = sg.stages[state.step + 1];
    if (coming && coming.kind === "rule") html("span", "next: " + coming.rule + " on #" + coming.changed.join(", #") + " (orange)", bar, "muted");
    legend(bar, false);
  }
  function legend(bar, partition) {
    const lg = html("span", null, bar, "legend");
    const kinds = partition ? ["library", "subgraph"] : ["elementwise", "reduce", "broadcast", "move"];
    for (const k of kinds) { const s = html("span", k, lg); s.style.background = KIND_COLOUR[k]; }
    if (!partition) for (const k in SCOPE_COLOUR) { const s = html("span", "sync " + k, lg); s.style.background = SCOPE_COLOUR[k]; }
  }
  function trafficPanel(sg) {
    const box = $("traffic");
    box.innerHTML = "";
    if (!sg || !sg.stages.length) return;
    const cur = sg.stages[state.step].gir;
    const t = html("table", null, box);
    const head = html("tr", null, t);
    for (const h of ["bytes moved", "merged (before)", "this stage", "final (after)"]) html("th", h, head);
    for (const lv of ["global", "shared", "register"]) {
      const r = html("tr", null, t);
      html("td", lv, r);
      html("td", fmtBytes(sg.traffic.before ? sg.traffic.before[lv] : null), r);
      html("td", fmtBytes(cur.traffic[lv]), r);
      html("td", fmtBytes(sg.traffic.after ? sg.traffic.after[lv] : null), r);
    }
    const r = html("tr", null, t);
    html("td", "kernels", r); html("td", sg.kernels.before, r); html("td", cur.kernels, r); html("td", sg.kernels.after, r);
  }
  function row(t, k, v) { const r = html("tr", null, t); html("td", k, r); html("td", v, r); }
  function details(sg, g) {
    const box = $("details");
    box.innerHTML = "";
    const n = g && state.node !== null ? g.nodes.find((m) => m.id === state.node) : null;
    if (!n) {
      html("h2", sg ? sg.name : DATA.model, box);
      if (sg && sg.error) html("pre", "failed at " + sg.failed_at + ":\n" + sg.error, box);
      if (sg && sg.note) html("div", "note: " + sg.note, box, "muted");
      if (sg) {
        html("div", "templates chosen:", box);
        const t = html("table", null, box);
        for (const c of sg.templates) row(t, c.node, c.template);
      } else html("div", "Click a node for details; click a subgraph's node to open its GIR.", box, "muted");
      return;
    }
    const d = n.data;
    html("h2", n.label, box);
    const t = html("table", null, box);
    if (d.io) { row(t, "interface", d.io); return; }
    if (!sg) {
      row(t, "ONNX node", d.name); row(t, "op type", d.op_type); row(t, "step", d.step + " (" + d.kind + ")");
      if (d.kind === "subgraph" && subByName.has(d.step)) {
        const b = html("button", "open " + d.step + " GIR", box);
        b.onclick = () => go({view: d.step, step: Math.max(subByName.get(d.step).stages.length - 1, 0), node: null});
      }
      html("div", "basic ops:", box);
      const bt = html("table", null, box);
      for (const b of d.basic) row(bt, b.name, b.op + " (" + b.kind + ") " + b.inputs.join(", ") + " \u2192 " + b.outputs.join(", "));
      return;
    }
    row(t, "uid", "#" + d.uid); row(t, "kind", d.kind + (d.scope ? " (" + d.scope + ")" : ""));
    row(t, "origin", d.origin || "-"); row(t, "cluster", d.cluster || "-"); row(t, "guard", d.guard || "all units");
    row(t, "traffic", Object.entries(d.traffic).map(([k, v]) => k + " " + fmtBytes(v)).join(", ") || "none");
    for (const [name, list] of [["inputs", d.inputs], ["outputs", d.outputs]]) {
      html("div", name + ":", box);
      const st = html("table", null, box);
      for (const s of list) row(st, s.buffer, s.label + "  index " + s.index + (s.valid ? "  valid " + s.valid : "") + (s.vec > 1 ? "  vec " + s.vec : ""));
    }
    const src = sourceLines(sg, d.uid);
    html("div", src ? "emitted source (" + src.kernel + ", lines " + src.first + "\u2013" + src.last + "):" :
      (sg.sources.length ? "not in the emitted source (this gOperator does not survive to the final graph)" :
       "no backend has run for this subgraph"), box, "muted");
    if (src) html("pre", src.text, box).id = "source-lines";
  }
  function sourceLines(sg, uid) {
    for (const k of sg.sources) {
      const span = k.op_lines[String(uid)];
      if (!span) continue;
      const lines = k.source.split("\n");
      const text = lines.slice(span[0] - 1, span[1]).map((l, i) => String(span[0] + i).padStart(4) + "  " + l).join("\n");
      return {kernel: k.name, first: span[0], last: span[1], text};
    }
    return null;
  }

  // ---- search --------------------------------------------------------------------------
  function search(g, d) {
    if ($("search").value !== state.search) $("search").value = state.search;
    const q = state.search.trim().toLowerCase();
    const res = $("results");
    res.innerHTML = "";
    document.querySelectorAll(".node, .edge").forEach((e) => e.classList.remove("dim", "match"));
    document.body.dataset.matches = "0";
    if (!q || !g) return;
    const hits = g.nodes.filter((n) => n.search.some((s) => s && String(s).toLowerCase().includes(q)));
    const hitIds = new Set(hits.map((n) => n.id));
    document.querySelectorAll(".node").forEach((e) => e.classList.add(hitIds.has(e.dataset.id) ? "match" : "dim"));
    document.querySelectorAll(".edge").forEach((e) => {
      if (!(hitIds.has(e.dataset.source) || hitIds.has(e.dataset.target))) e.classList.add("dim");
    });
    document.body.dataset.matches = String(hits.length);
    html("div", hits.length + " match(es) here", res, "muted");
    for (const n of hits.slice(0, 100)) {
      const it = html("div", n.label + "  " + (n.sub || ""), res, "item");
      it.onclick = () => { go({node: n.id}); centreOn(d, n.id); };
    }
    // other subgraphs with matches, so a name can be found anywhere in the model
    for (const sg of subgraphs) {
      if (sg.name === state.view) continue;
      const last = sg.stages[sg.stages.length - 1];
      const names = sg.onnx_nodes.concat(sg.inputs, sg.outputs, last ? last.gir.buffers.map((b) => b.name) : []);
      if (names.some((s) => s.toLowerCase().includes(q))) {
        const it = html("div", "\u2192 in " + sg.name, res, "item");
        it.onclick = () => go({view: sg.name, step: Math.max(sg.stages.length - 1, 0), node: null});
      }
    }
  }

  // ---- main render -----------------------------------------------------------------------
  let lastKey = null;
  function render() {
    const sg = state.view === "partition" ? null : subByName.get(state.view);
    sidebar(); stepper(sg); trafficPanel(sg);
    $("message").textContent = "";
    let g = null, d = null;
    if (!sg && DATA.partition) g = partitionGraph();
    else if (sg && sg.stages.length) g = girGraph(sg, sg.stages[state.step]);
    if (sg && sg.error) $("message").textContent = sg.name + " failed at " + sg.failed_at + ": " + sg.error;
    if (g) {
      const key = currentKey();
      g = collapse(g, key);
      const closedKey = key + "|" + [...state.collapsed[key]].sort().join(",") + "|" + state.labels;
      d = layout(g, closedKey);
      draw(g, d);
      if (lastKey !== state.view) { fit(d); lastKey = state.view; }
    } else $("graph").innerHTML = "";
    details(sg, g);
    search(g, d);
    document.body.dataset.view = state.view;
    document.body.dataset.step = String(state.step);
    document.body.dataset.nodes = g ? String(g.nodes.length) : "0";
    document.body.dataset.ready = "1";
  }

  function wire() {
    $("title").textContent = DATA.model + " \u2014 " + (DATA.target || "GIR");
    $("search").value = state.search;
    $("search").oninput = (e) => go({search: e.target.value});
    $("labels").onchange = (e) => { state.labels = e.target.checked; render(); };
    $("fit").onclick = () => { const k = currentKey(); for (const [ck, d] of layoutCache) if (ck.startsWith(k + "|")) fit(d, true); };
    $("expand").onclick = () => { state.collapsed[currentKey()] = new Set(); render(); };
    $("collapse").onclick = () => { state.collapsed[currentKey()] = new Set(currentClusters); render(); };
    const svg = $("graph");
    let drag = null;
    svg.addEventListener("mousedown", (e) => { drag = {x: e.clientX - view.x, y: e.clientY - view.y}; });
    window.addEventListener("mouseup", () => { drag = null; });
    svg.addEventListener("mousemove", (e) => { if (drag) { view.x = e.clientX - drag.x; view.y = e.clientY - drag.y; applyTransform(); } });
    svg.addEventListener("wheel", (e) => {
      e.preventDefault();
      const f = Math.exp(-e.deltaY * 0.0015), r = svg.getBoundingClientRect();
      const px = e.clientX - r.left, py = e.clientY - r.top;
      view.x = px - (px - view.x) * f; view.y = py - (py - view.y) * f; view.scale *= f;
      applyTransform();
    }, {passive: false});
    svg.addEventListener("click", () => { if (state.node !== null) go({node: null}); });
    window.addEventListener("keydown", (e) => {
      if (e.target.tagName === "INPUT") return;
      const sg = subByName.get(state.view);
      if (!sg) return;
      if (e.key === "ArrowRight" && state.step < sg.stages.length - 1) go({step: state.step + 1, node: null});
      if (e.key === "ArrowLeft" && state.step > 0) go({step: state.step - 1, node: null});
    });
    window.addEventListener("hashchange", () => { readHash(); render(); });
  }

  readHash();
  wire();
  writeHash();
  render();
})();
