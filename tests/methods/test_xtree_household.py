"""Planted structure: the household env's scripted expert solves 20 train tasks of each type; X-Tree mined over
all 120 of them together finds each type's known sub-routine (from the env's recipes) as a node."""

from collections import Counter

from rsiflow.envs.household import TASK_TYPES, HouseholdEnv
from rsiflow.methods.xtree.algorithm import Trace, executed, mine

GO, TAKE, PUT = "go<receptacle>", "take<object,receptacle>", "put<object,receptacle>"
SUBROUTINE = {
    "pick_and_place": [TAKE, GO, PUT],                              # take it, go to the target, put it
    "look_at_obj_in_light": [TAKE, GO, "use<lamp>"],                # take it, go to the lamp, use the lamp
    "pick_clean_then_place": ["clean<object,sink>", GO, PUT],       # clean at the sink, go to the target, put
    "pick_heat_then_place": [TAKE, GO, "heat<object,microwave>"],   # take it, go to the microwave, heat
    "pick_cool_then_place": [GO, "cool<object,fridge>", GO, PUT],   # go to the fridge, cool, go, put
    "pick_two_obj_and_place": [PUT, GO, TAKE, GO, PUT],            # the first one placed, fetch and place the second
}


def expert_corpus(n_tasks: int = 120) -> list[Trace]:
    env = HouseholdEnv()
    out = []
    for task in env.sample_tasks("train", n_tasks, seed=0):
        env.reset(task)
        out.append(Trace(task.task_id, [env.canonicalize(a) for a in env.solution()], True, task.task_type))
    return out


def characteristic_node(tree, corpus: list[Trace], task_type: str):
    """The longest node (then the highest-scoring) that at least 40% of the type's trajectories execute."""
    own = [t for t in corpus if t.label == task_type]
    runs = Counter(i for t in own for i in executed(tree.nodes, t.symbols))
    return max((n for n in tree.nodes if runs[n.idx] >= 0.4 * len(own)), key=lambda n: (n.length, n.score))


def contains(span: tuple, part: list) -> bool:
    return any(list(span[i:i + len(part)]) == part for i in range(len(span) - len(part) + 1))


def test_each_task_types_subroutine_is_a_node_of_the_expert_tree():
    corpus = expert_corpus()
    assert Counter(t.label for t in corpus) == dict.fromkeys(TASK_TYPES, 20)
    tree = mine(corpus)
    for task_type, part in SUBROUTINE.items():
        node = characteristic_node(tree, corpus, task_type)
        assert contains(node.span, part), f"{task_type}: {node.span}"
        assert node.succ == 1.0 and node.depth >= 2
