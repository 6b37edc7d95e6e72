"""Token trees on the verifier's side: reshaping a draft tree and the greedy accept walk. Pure.

A tree is (tokens, parents) as the draft service proposes it and es_forward_tree takes it:
node i holds tokens[i] and follows node parents[i], or the history's last token when
parents[i] is -1; parents precede children. A chain is the tree with parents [-1, 0, 1, ...].

A tree round verifies the pending token (the last round's bonus, not yet in the KV cache)
as node 0 and the draft tree below it (``verify_tree``), in one forward. Greedy decoding
from node 0 takes argmax[node]; ``accept`` follows the child holding that token while there
is one: those children are the accepted drafts, and the argmax of the last node reached is
the bonus token. That is what a chain verify of the accepted path gives (the engine's tree
contract), so the output is plain greedy decoding's whatever the tree.

Example: pending p, draft tokens [a, b, c], parents [-1, 0, -1] (a -> b, and c):
verify_tree -> tokens [p, a, b, c], parents [-1, 0, 1, 0]. With argmax [c, x, y, z] the walk
takes c (node 3; a is not the argmax), then argmax[3] = z has no child: path [0, 3],
accepted [c], bonus z.
"""
from __future__ import annotations

from typing import Sequence


def is_chain(parents: Sequence[int]) -> bool:
    """True for a tree of width 1 (parents [-1, 0, 1, ...]), the empty tree included."""
    return all(p == i - 1 for i, p in enumerate(parents))


def first_branch(tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
    """The tokens along the tree's first branch: its first root, then each node's first child."""
    out: list[int] = []
    node = -1
    while True:
        nxt = next((i for i in range(node + 1, len(parents)) if parents[i] == node), None)
        if nxt is None:
            return out
        out.append(tokens[nxt])
        node = nxt


def reroot(tokens: Sequence[int], parents: Sequence[int], walk: Sequence[int]
           ) -> tuple[list[int], list[int]] | None:
    """The subtree below the node reached by following ``walk``'s tokens from the roots (the
    tree continuing history + walk), renumbered, its top nodes roots; None when the walk
    leaves the tree. An empty walk gives the whole tree."""
    sub = reroot_nodes(tokens, parents, walk)
    return None if sub is None else (sub[0], sub[1])


def reroot_nodes(tokens: Sequence[int], parents: Sequence[int], walk: Sequence[int]
                 ) -> tuple[list[int], list[int], list[int]] | None:
    """``reroot``, and for each node of the subtree its index in the tree given."""
    node = -1
    for t in walk:
        node = next((i for i in range(node + 1, len(parents))
                     if parents[i] == node and tokens[i] == t), None)
        if node is None:
            return None
    new: dict[int, int] = {node: -1}
    out_t: list[int] = []
    out_p: list[int] = []
    orig: list[int] = []
    for i in range(node + 1, len(parents)):
        if parents[i] in new:
            new[i] = len(out_t)
            out_t.append(tokens[i])
            out_p.append(new[parents[i]])
            orig.append(i)
    return out_t, out_p, orig


def trim(tokens: Sequence[int], parents: Sequence[int], budget: int, depth: int
         ) -> tuple[list[int], list[int]]:
    """The first ``budget`` nodes (index order) at most ``depth`` deep (a root is depth 1),
    renumbered; a node whose parent is left out is left out."""
    new: dict[int, int] = {-1: -1}
    d: dict[int, int] = {-1: 0}
    out_t: list[int] = []
    out_p: list[int] = []
    for i, p in enumerate(parents):
        if len(out_t) >= budget:
            break
        if p in new and d[p] < depth:
            new[i] = len(out_t)
            d[i] = d[p] + 1
            out_t.append(tokens[i])
            out_p.append(new[p])
    return out_t, out_p


def verify_tree(pending: int, tokens: Sequence[int], parents: Sequence[int]
                ) -> tuple[list[int], list[int]]:
    """The engine's tree for a round: the pending token as node 0, the draft tree below it."""
    return [pending] + list(tokens), [-1] + [p + 1 if p >= 0 else 0 for p in parents]


def accept(tokens: Sequence[int], parents: Sequence[int], argmax: Sequence[int]
           ) -> tuple[list[int], list[int], int]:
    """The greedy walk over a verified round tree (``verify_tree``'s, argmax per node):
    (path of node indices from node 0, accepted draft tokens, bonus token)."""
    path = [0]
    node = 0
    while True:
        g = int(argmax[node])
        nxt = next((i for i in range(node + 1, len(parents))
                    if parents[i] == node and tokens[i] == g), None)
        if nxt is None:
            return path, [tokens[i] for i in path[1:]], g
        path.append(nxt)
        node = nxt


def round_tree(tokens: Sequence[int], parents: Sequence[int], chain: Sequence[int], budget: int,
               depth: int) -> tuple[list[int], list[int]] | None:
    """A round's tree from a proposal tree continuing the history: the path spelling ``chain``
    from the roots (every node of it, whatever the budget), then the other nodes in index order
    whose parent is kept, at most ``depth`` deep, while the tree holds fewer than ``budget``
    nodes; renumbered in index order. None when the tree does not spell ``chain`` or the result
    is a chain (nothing beside it: the round verifies the chain as ever).

    Example: tokens [10, 11, 12, 13, 14], parents [-1, 0, 1, 0, -1] (10 -> 11 -> 12, 10 -> 13, 14);
    chain [10, 11], budget 4, depth 2 -> tokens [10, 11, 13, 14], parents [-1, 0, 0, -1].
    """
    keep: set[int] = set()
    node = -1
    for t in chain:
        node = next((i for i in range(node + 1, len(parents))
                     if parents[i] == node and tokens[i] == t), None)
        if node is None:
            return None
        keep.add(node)
    d: dict[int, int] = {-1: 0}   # depths (a root is 1)
    for i, p in enumerate(parents):
        if p in d:
            d[i] = d[p] + 1
    # the others in index order, under a kept parent (a parent precedes its children)
    kept: set[int] = set(keep)
    n = len(kept)
    for i, p in enumerate(parents):
        if i in keep or n >= budget:
            continue
        if (p == -1 or p in kept) and i in d and d[i] <= depth:
            kept.add(i)
            n += 1
    order = sorted(kept)
    new = {-1: -1}
    out_t: list[int] = []
    out_p: list[int] = []
    for i in order:
        new[i] = len(out_t)
        out_t.append(tokens[i])
        out_p.append(new[parents[i]])
    return None if is_chain(out_p) else (out_t, out_p)
