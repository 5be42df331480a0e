//! A random tree stored parent-before-child after a prompt chain, as pre-order numbers and
//! subtree ends (shared by the planner's tests and benches).

use rand::Rng;

/// Pre-order numbers and subtree ends of `n` tokens: a chain of `prefix` tokens, then nodes
/// whose parent is a random earlier node at or after the chain's end. Token `j` is an
/// ancestor-or-self of `i` exactly when `pre[j] <= pre[i] < end[j]`.
pub fn tree_features(rng: &mut impl Rng, n: usize, prefix: usize) -> (Vec<i64>, Vec<i64>) {
    let mut kids = vec![Vec::new(); n];
    for i in 1..n {
        let p = if i <= prefix {
            i - 1
        } else {
            rng.gen_range(prefix.saturating_sub(1)..i)
        };
        kids[p].push(i);
    }
    let (mut pre, mut end) = (vec![0i64; n], vec![0i64; n]);
    let mut next = 0i64;
    // Iterative DFS: (node, its subtree done).
    let mut stack = vec![(0usize, false)];
    while let Some((v, done)) = stack.pop() {
        if done {
            end[v] = next;
            continue;
        }
        pre[v] = next;
        next += 1;
        stack.push((v, true));
        stack.extend(kids[v].iter().rev().map(|&c| (c, false)));
    }
    (pre, end)
}
