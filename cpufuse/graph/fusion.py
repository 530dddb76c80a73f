"""The fusion stage, fuse(graph) -> (steps, rejected): the graph's nodes as steps (kernel calls),
each rule checking ggml's legality (consecutive nodes, single-consumer intermediates that are neither outputs nor views).
The rules are listed in cpufuse/graph/executor.py's docstring and docs/semantics.md."""
from .ir import F32, GraphError, Step, _softmax_mask_ok, _suffix_tiles, compute_nodes


def fuse(graph, enabled=True):
    """The fusion stage: the graph's compute nodes as steps (kernel calls), in execution order, and
    the fusion candidates that were rejected (one reason each). enabled=False: one step per node."""
    f = _Fuser(graph)
    done = set()
    steps = []
    for n in f.order:
        if n.id in done:
            continue
        st = f.try_fuse(n) if enabled else None
        if st is None:
            st = _single(n)
        for m in st.nodes:
            done.add(m.id)
        steps.append(st)
    return steps, f.rejected


class _Fuser:
    """The facts the fusion rules read, computed once from the graph: every node's use count and
    consumers, the outputs, the execution order; and the reasons of the rejected candidates."""

    def __init__(self, graph):
        nodes = graph.nodes
        self._uses = [0] * len(nodes)
        self._consumers = [[] for _ in nodes]
        for n in nodes:
            for s in n.srcs:
                if s is not None:
                    self._uses[s.id] += 1
                    self._consumers[s.id].append(n)
        self._outset = {n.id for n in graph.outputs}
        self.order = compute_nodes(graph)
        self.pos = {n.id: i for i, n in enumerate(self.order)}
        self.rejected = []

    def try_fuse(self, n):
        return self._try_fuse(n, self.order, self.pos)

    # -- legality (docs/semantics.md §5) ------------------------------------------------------------
    def _intermediate(self, node, label):
        """single consumer, not an output, not a view: None or the reason it fails"""
        if self._uses[node.id] != 1:
            return f"{label}: {node.name!r} has {self._uses[node.id]} consumers"
        if node.id in self._outset:
            return f"{label}: {node.name!r} is a graph output"
        if node.is_view:
            return f"{label}: {node.name!r} is a view"
        return None

    def _fusible_intermediate(self, node, nxt, order_pos, label):
        """_intermediate, and `nxt` directly follows `node` with its shape: None or the reason"""
        why = self._intermediate(node, label)
        if why is None and order_pos[nxt.id] != order_pos[node.id] + 1:
            why = f"{label}: {nxt.name!r} does not directly follow {node.name!r}"
        if why is None and nxt.shape != node.shape:
            why = f"{label}: shape {nxt.shape} != {node.shape}"
        return why

    def _other(self, binop, node):
        a, b = binop.srcs
        if a is node and b is node:
            return None
        return b if a is node else a

    def _try_fuse(self, n, order, pos):
        if n.op == "add" and not n.is_view:
            # ADD -> RMS_NORM (-> MUL (-> ADD)): the residual pattern, h kept (two outputs)
            norms = [c for c in self._consumers[n.id] if c.op == "rms_norm" and pos.get(c.id) == pos[n.id] + 1]
            if norms and self._qgroup_after_norm(norms[0], pos, order, quiet=True) is not None:
                self.rejected.append(f"ADD -> RMS_NORM: {norms[0].name!r} is folded into the QMATMUL "
                                     f"prologue instead")
                norms = []
            if norms:
                r = norms[0]
                x, res = n.srcs
                if x.shape != n.shape:
                    x, res = res, x
                w, b, tail = self._norm_tail(r, order, pos)
                if w is n or b is n:
                    self.rejected.append(f"ADD -> RMS_NORM: {n.name!r} is also the weight or bias of "
                                         f"its own norm")
                    return None
                return Step("add_rms_norm", [n, r] + tail, [x, res, w, b], [n, tail[-1] if tail else r],
                            {"eps": r.params["eps"]},
                            note="ADD -> RMS_NORM" + "".join(" -> " + t.op.upper() for t in tail))
        if n.op == "rms_norm":
            st = self._qgroup_after_norm(n, pos, order)
            if st is not None:
                return st
            w, b, tail = self._norm_tail(n, order, pos)
            if tail:
                return Step("rms_norm", [n] + tail, [n.srcs[0], None, w, b], [None, tail[-1]],
                            {"eps": n.params["eps"]}, note="RMS_NORM" + "".join(" -> " + t.op.upper() for t in tail))
            return None
        if n.op in ("scale", "add"):
            return self._softmax_chain(n, pos)
        if n.op == "qmatmul":
            grp = self._qgroup(n, order, pos)
            if grp is not None:
                return self._qstep(grp, None)
            return self._qmm_residual(n, pos)
        return self._try_fuse_rest(n, order, pos)

    def _qmm_residual(self, n, pos):
        """QMATMUL [-> SCALE] -> ADD(product, r): the add folded into the matmul's epilogue (QM_EPI 2:
        one f32 add per element, as the ADD kernel does; with the SCALE, QM_EPI 5: the product times s
        rounded first, as the SCALE kernel does: granite's residual scale), or None (reason recorded)"""
        t = self._residual_tail(n, pos, "QMATMUL")
        if t is None:
            sc = self._scale_tail(n, pos)
            if sc is None:
                return None
            return Step("qmatmul", [n, sc], [n.srcs[0], None], [sc],
                        {"ws": (n.params["w"],), "act": n.params["act"], "eps": None, "post_scale": sc.params["s"]},
                        note="QMATMUL -> SCALE (the scale in the epilogue)")
        nodes, r, label, p = t
        p.update({"ws": (n.params["w"],), "act": n.params["act"], "eps": None})
        return Step("qmatmul", nodes, [n.srcs[0], None, r], [nodes[-1]], p,
                    note=label + " (the residual in the epilogue)")

    def _wsum_residual(self, n, pos):
        """WSUM [-> SCALE] -> ADD(sum, r): a MoE layer's residual add (and granite's scale) done by the
        weighted sum as it writes each element, rounded as the SCALE and ADD kernels round"""
        t = self._residual_tail(n, pos, "WSUM")
        if t is None:
            return None
        nodes, r, label, p = t
        return Step("wsum", nodes, list(n.srcs) + [r], [nodes[-1]], p, note=label + " (the residual in the sum)")

    def _scale_tail(self, n, pos):
        """n's single consumer, a SCALE right after it that is not the start of a [SCALE ->] ADD chain
        another rule takes: that SCALE (QM_EPI 6: the product times s rounded, as the SCALE kernel does;
        granite's logit scale), or None"""
        cons = self._consumers[n.id]
        if len(cons) != 1 or cons[0].op != "scale":
            return None
        sc = cons[0]
        if self._intermediate(n, "") is not None or pos.get(sc.id) != pos[n.id] + 1 or sc.shape != n.shape:
            return None
        return sc

    def _residual_tail(self, n, pos, head):
        """n's single consumer chain [SCALE ->] ADD(., r), each node directly after the last, of n's shape
        and float32, no views: (nodes from n to the ADD, r, label, {"post_scale": s} or {}), or None (a reason
        recorded where the chain is there but cannot fuse)"""
        cons = self._consumers[n.id]
        sc = None
        if len(cons) == 1 and cons[0].op == "scale" and len(self._consumers[cons[0].id]) == 1:
            sc, cons = cons[0], self._consumers[cons[0].id]
        if len(cons) != 1 or cons[0].op != "add":
            return None
        a = cons[0]
        label = f"{head} -> SCALE -> ADD" if sc is not None else f"{head} -> ADD"
        why = self._intermediate(n, label)
        if why is None and sc is not None:
            why = self._fusible_intermediate(n, sc, pos, label) or self._intermediate(sc, label)
        prod = n if sc is None else sc
        r = self._other(a, prod)
        if why is None and r is None:
            why = f"{label}: ADD({prod.name!r}, {prod.name!r}) adds the product to itself"
        if why is None and pos.get(a.id) != pos[prod.id] + 1:
            why = f"{label}: {a.name!r} does not directly follow {prod.name!r}"
        if why is None and (r.shape != a.shape or n.shape != a.shape or r.dtype != F32):
            why = f"{label}: ADD {a.name!r} {a.shape} broadcasts or is not float32"
        if why is None and (a.is_view or r.is_view):
            why = f"{label}: {(a if a.is_view else r).name!r} is a view"
        if why:
            self.rejected.append(why)
            return None
        return [n] + ([sc] if sc is not None else []) + [a], r, label, ({} if sc is None else {"post_scale": sc.params["s"]})

    def _try_fuse_rest(self, n, order, pos):
        """_try_fuse for the remaining op kinds (rope, silu/gelu)"""
        if n.op == "rope":
            return self._rope_cache(n, pos)
        if n.op == "wsum":
            return self._wsum_residual(n, pos)
        if n.op in ("silu", "gelu"):
            cons = self._consumers[n.id]
            if cons and cons[0].op == "mul":
                m = cons[0]
                label = n.op.upper() + " -> MUL"
                u, why = self._mul_operand(n, m, pos, label)
                if why is None:
                    return Step("swiglu" if n.op == "silu" else "geglu", [n, m], [n.srcs[0], u], [m], note=label)
                self.rejected.append(why)
        return None

    # -- quantized matmul groups -----------------------------------------------------------------
    def _swiglu_group(self, n, order, pos, record=True):
        """n a QMATMUL: (gate, up, silu, mul) when n is the gate or up product of the SwiGLU pattern
        QMATMUL(x,Wg) -> SILU -> MUL(silu, QMATMUL(x,Wu)), else None (reason recorded if any)."""
        cons = self._consumers[n.id]
        if len(cons) != 1:
            return None
        c = cons[0]
        if c.op in ("silu", "gelu"):
            s = c
            sc = self._consumers[s.id]
            if len(sc) != 1 or sc[0].op != "mul":
                return None
            m = sc[0]
            g, u = n, self._other(m, s)
        elif c.op == "mul":
            m = c
            s = self._other(m, n)
            if s is None or s.op not in ("silu", "gelu") or s.srcs[0].op != "qmatmul":
                return None
            g, u = s.srcs[0], n
        else:
            return None
        if u is None or u.op != "qmatmul" or g is u:
            return None
        label = f"QMATMUL x2 -> {s.op.upper()} -> MUL"
        why = None
        for node in (g, u, s):
            why = why or self._intermediate(node, label)
        if why is None and g.srcs[0] is not u.srcs[0]:
            why = f"{label}: {g.name!r} and {u.name!r} read different inputs"
        if why is None and g.params["act"] != u.params["act"]:
            why = f"{label}: {g.name!r} and {u.name!r} use different act modes"
        if why is None and tuple(g.params["w"].shape) != tuple(u.params["w"].shape):
            why = f"{label}: weights {tuple(g.params['w'].shape)} and {tuple(u.params['w'].shape)} differ in shape"
        if why is None and m.shape != s.shape:
            why = f"{label}: MUL {m.name!r} {m.shape} broadcasts"
        if why is None:
            ps = sorted(pos[k.id] for k in (g, u, s, m))
            if ps != list(range(ps[0], ps[0] + 4)):
                why = f"{label}: {g.name!r}, {u.name!r}, {s.name!r}, {m.name!r} are not consecutive"
        if why:
            if record:
                self.rejected.append(why)
            return None
        return [g, u, s, m]

    def _qgroup(self, n, order, pos, record=True):
        """the fused QMATMUL group starting at n (the first in execution order): ("swiglu", nodes)
        or ("multi", [2..3 qmatmuls]) or None."""
        sw = self._swiglu_group(n, order, pos, record)
        if sw is not None:
            if pos[sw[0].id] == pos[n.id] or pos[sw[1].id] == pos[n.id]:
                return ("swiglu", sw)
            return None
        grp = [n]
        i = pos[n.id] + 1
        while len(grp) < 3 and i < len(order):
            c = order[i]
            if c.op != "qmatmul" or c.srcs[0] is not n.srcs[0] or c.params["act"] != n.params["act"]:
                break
            grp.append(c)
            i += 1
        return ("multi", grp) if len(grp) > 1 else None

    def _qgroup_after_norm(self, r, pos, order, quiet=False):
        """RMS_NORM r -> MUL(w) -> a QMATMUL group reading exactly the MUL: the fused step, or None"""
        cons = self._consumers[r.id]
        if len(cons) != 1 or cons[0].op != "mul":
            return None
        m = cons[0]
        mc = self._consumers[m.id]
        if not mc or not all(c.op == "qmatmul" for c in mc):
            return None
        label = "RMS_NORM -> MUL -> QMATMUL"
        why = self._intermediate(r, label)
        w = self._other(m, r)
        if why is None and (w is None or pos.get(m.id) != pos[r.id] + 1):
            why = f"{label}: {m.name!r} does not directly follow {r.name!r}" if w is not None else \
                f"{label}: MUL(n, n) uses {r.name!r} twice"
        n_in = r.shape[-1] if r.shape else 0
        if why is None:
            ws = list(w.shape)
            while len(ws) > 1 and ws[0] == 1:
                ws.pop(0)
            if w.op not in ("const", "input") or w.is_view or w.dtype != F32 or tuple(ws) != (n_in,):
                why = (f"{label}: the norm weight {w.name!r} must be a float32 const or input node of shape "
                       f"({n_in},), got {w.op} {w.dtype} {w.shape}")
        if why is None and m.id in self._outset:
            why = f"{label}: {m.name!r} is a graph output"
        if why is None and m.shape != r.shape:
            why = f"{label}: MUL {m.name!r} {m.shape} broadcasts"
        first = min(mc, key=lambda c: pos[c.id])
        grp = None
        if why is None and pos[first.id] != pos[m.id] + 1:
            why = f"{label}: {first.name!r} does not directly follow {m.name!r}"
        if why is None:
            grp = self._qgroup(first, order, pos, record=not quiet) or ("multi", [first])
            qs = grp[1][:2] if grp[0] == "swiglu" else grp[1]
            if {c.id for c in mc} != {q.id for q in qs} or self._uses[m.id] != len(qs):
                why = (f"{label}: the consumers of {m.name!r} ({', '.join(c.name for c in mc)}) are not "
                       f"exactly one fused QMATMUL group ({', '.join(q.name for q in qs)})")
        if why:
            if not quiet:
                self.rejected.append(why)
            return None
        return self._qstep(grp, (r, m, w))

    def _qstep(self, grp, norm):
        kind, nodes = grp
        r = m = w = None
        if norm is not None:
            r, m, w = norm
        pre = [r, m] if norm is not None else []
        x = r.srcs[0] if norm is not None else nodes[0].srcs[0]
        eps = r.params["eps"] if norm is not None else None
        head = "RMS_NORM -> MUL -> " if norm is not None else ""
        act = nodes[0].params["act"]
        if kind == "swiglu":
            g, u, s, mm = nodes
            if s.op == "gelu":
                return Step("qmatmul_geglu", pre + nodes, [x, w], [mm],
                            {"ws": (g.params["w"], u.params["w"]), "act": act, "eps": eps},
                            note=head + "QMATMUL x2 -> GELU -> MUL (matmul_geglu)")
            return Step("qmatmul_swiglu", pre + nodes, [x, w], [mm],
                        {"ws": (g.params["w"], u.params["w"]), "act": act, "eps": eps},
                        note=head + "QMATMUL x2 -> SILU -> MUL (matmul_swiglu)")
        k = len(nodes)
        note = head + ("QMATMUL" if k == 1 else f"QMATMUL x{k} (shared activation)")
        p = {"ws": tuple(q.params["w"] for q in nodes), "act": act, "eps": eps}
        sc = self._scale_tail(nodes[0], self.pos) if k == 1 else None
        if sc is not None:   # one weight: a SCALE of its product in the epilogue (granite's logit scale)
            p["post_scale"] = sc.params["s"]
            return Step("qmatmul", pre + nodes + [sc], [x, w], [sc], p, note=note + " -> SCALE (in the epilogue)")
        return Step("qmatmul", pre + nodes, [x, w], list(nodes), p, note=note)

    def _rope_cache(self, n, pos):
        cons = self._consumers[n.id]
        if len(cons) != 1 or cons[0].op != "cache_write":
            return None
        cw = cons[0]
        why = self._intermediate(n, "ROPE -> CACHE_WRITE")
        if why is None and pos[cw.id] != pos[n.id] + 1:
            why = f"ROPE -> CACHE_WRITE: {cw.name!r} does not directly follow {n.name!r}"
        if why:
            self.rejected.append(why)
            return None
        return Step("rope_cache", [n, cw], [n.srcs[0], n.srcs[1], cw.srcs[1]], [cw],
                    {"n_dims": n.params["n_dims"], "mode": n.params["mode"], "kw": n.params["kw"],
                     "cache": cw.params["cache"]}, note="ROPE -> CACHE_WRITE")

    def _mul_operand(self, n, m, pos, label):
        """MUL m consuming n: (its other operand, None) if n may fuse into it, else (_, reason)"""
        why = self._fusible_intermediate(n, m, pos, label)
        other = self._other(m, n)
        if why is None and other is None:
            why = f"{label}: MUL(n, n) uses {n.name!r} twice"
        if why is None and not (other.shape == n.shape or _suffix_tiles(other.shape, n.shape)):
            why = f"{label}: {other.name!r} {other.shape} does not tile {n.shape}"
        return other, why

    def _norm_tail(self, r, order, pos):
        """RMS_NORM's MUL (and ADD) if they can join the rms_norm kernel: (weight, bias, nodes)."""
        cons = self._consumers[r.id]
        muls = [c for c in cons if c.op == "mul"]
        if not muls:
            for c in cons:
                if c.is_view and any(cc.op == "mul" for cc in self._consumers[c.id]):
                    self.rejected.append(f"RMS_NORM -> MUL: {r.name!r} reaches the MUL through the view "
                                         f"{c.name!r}")
            return None, None, []
        m = muls[0]
        w, why = self._mul_operand(r, m, pos, "RMS_NORM -> MUL")
        if why:
            self.rejected.append(why)
            return None, None, []
        mc = self._consumers[m.id]
        if mc and mc[0].op == "add":
            a = mc[0]
            why = self._fusible_intermediate(m, a, pos, "MUL -> ADD")
            b = self._other(a, m)
            if why is None and (b is None or not (b.shape == m.shape or _suffix_tiles(b.shape, m.shape))):
                why = f"MUL -> ADD: bias does not tile {m.shape}"
            if why is None:
                return w, b, [m, a]
            self.rejected.append(why)
        return w, None, [m]

    def _softmax_chain(self, n, pos):
        """[SCALE ->] [ADD(mask) ->] SOFT_MAX starting at n, as one soft_max_ext call"""
        chain, scale, mask = [n], 1.0, None
        if n.op == "scale":
            scale, src = n.params["s"], n.srcs[0]
            cons = self._consumers[n.id]
            if cons and cons[0].op == "add" and self._fusible_intermediate(n, cons[0], pos, "") is None:
                mask = self._other(cons[0], n)
                if mask is not None:
                    chain.append(cons[0])
        else:
            src, mask = n.srcs
            if src.shape != n.shape:
                src, mask = mask, src
        last = chain[-1]
        cons = self._consumers[last.id]
        if not cons or cons[0].op != "softmax" or cons[0].srcs[0] is not last:
            return None
        sm = cons[0]
        label = " -> ".join(c.op.upper() for c in chain) + " -> SOFT_MAX"
        why = self._fusible_intermediate(last, sm, pos, label)
        if why is None and (sm.srcs[1] is not None or sm.params["max_bias"] != 0.0):
            why = f"{label}: the softmax already has a mask or ALiBi"
        if why is None and mask is not None and sm.params["scale"] != 1.0:
            why = f"{label}: the softmax's own scale would multiply the mask too"
        if why is None and mask is not None:
            if mask.dtype != F32:
                why = f"{label}: mask {mask.name!r} must be float32"
            else:
                try:
                    _softmax_mask_ok(mask.shape, last.shape, sm.name)
                except GraphError:
                    why = f"{label}: {mask.name!r} {mask.shape} is not a soft_max_ext mask for {last.shape}"
        if why:
            self.rejected.append(why)
            return None
        return Step("softmax", chain + [sm], [src, mask, sm.srcs[2]], [sm],
                    {"scale": scale * sm.params["scale"], "max_bias": 0.0}, note=label)


def _single(n):
    """the step of one node, unfused"""
    kind = n.op   # every compute node's op is a step kind of its own
    if kind == "qmatmul":
        return Step(kind, [n], [n.srcs[0], None], [n], {"ws": (n.params["w"],), "act": n.params["act"], "eps": None})
    if kind == "rms_norm":
        return Step(kind, [n], [n.srcs[0], None, None, None], [None, n], {"eps": n.params["eps"]})
    if kind == "softmax":
        return Step(kind, [n], [n.srcs[0], n.srcs[1], n.srcs[2]], [n], dict(n.params))
    return Step(kind, [n], [s for s in n.srcs], [n], dict(n.params))
