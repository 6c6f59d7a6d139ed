// The suffix proposer's tree in C++: the same depth-bounded suffix trie, the same counts and the same
// drafts as the Python `SuffixTree` in suffix.py, whose docstrings define every rule below (this file is
// a line-by-line port; tests/unit/test_suffix_native.py checks that both draft the same tokens with the
// same probabilities on random workloads, including removals). Why it exists: at 16 concurrent requests
// on the H200 the Python tree's ingestion (~16 us per token) and drafting took about as long as the GPU
// step (docs/adaptive-speculation.md). With this tree a request-step of the proposer (ingest + draft,
// Python wrapper included) costs ~4x less and leaves no Python objects for the garbage collector
// (docs/benchmarks/suffix_speed_native_cpu.json: 26.4 -> 6.7 us on the 2-core Intel VM).
//
// Layout: a Node holds its children as a small vector of Child (an index map is added from kIndexed
// children on, e.g. at the root). A Child is a real Node or a tail: a chain of count-1 nodes owned by one
// suffix, stored as a window (seq, pos, limit) into that sequence. The "most frequent child" follows
// the Python tree's rules exactly: it is updated incrementally as counts grow (a tie keeps the current
// best), and where it is recomputed (after a removal) ties go to the child inserted first, as Python's
// max() over a dict does: each Child keeps its insertion stamp, and turning a tail into a node keeps its
// stamp (a dict assignment to an existing key keeps its place). So both trees' drafts can depend on the
// history of insertions and removals, identically.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

using Token = int64_t;
using Seq = std::vector<Token>;
constexpr size_t kIndexed = 12;  // children from which a node keeps a token -> slot map

struct Node;

struct Child {
  Token token = 0;
  uint64_t stamp = 0;              // insertion order among the tree's children
  std::unique_ptr<Node> node;      // a real node, or null for a tail
  const Seq* seq = nullptr;        // tail: tokens (*seq)[pos, min(size, limit)), owned by sequence sid
  int64_t pos = 0, limit = 0, sid = 0;
  inline int64_t count() const;
};

struct Node {
  int64_t count;
  int64_t cont = 0;                // suffixes through this node that continue to a child
  bool has_best = false;
  Token best = 0;                  // token of the most frequent child (valid if has_best)
  std::vector<Child> kids;
  std::unordered_map<Token, uint32_t> index;  // token -> slot in kids, once kids reached kIndexed

  explicit Node(int64_t c) : count(c) {}

  Child* find(Token t) {
    if (!index.empty()) {
      auto it = index.find(t);
      return it == index.end() ? nullptr : &kids[it->second];
    }
    for (auto& c : kids)
      if (c.token == t) return &c;
    return nullptr;
  }
  Child& add(Child&& c) {  // invalidates Child pointers into this node
    kids.push_back(std::move(c));
    if (!index.empty()) {
      index[kids.back().token] = static_cast<uint32_t>(kids.size() - 1);
    } else if (kids.size() >= kIndexed) {
      for (uint32_t i = 0; i < kids.size(); ++i) index[kids[i].token] = i;
    }
    return kids.back();
  }
  void erase(Token t) {  // t must be a child; the last child takes its slot
    size_t i = 0;
    if (!index.empty()) {
      auto it = index.find(t);
      i = it->second;
      index.erase(it);
    } else {
      while (kids[i].token != t) ++i;
    }
    if (i + 1 != kids.size()) {
      kids[i] = std::move(kids.back());
      if (!index.empty()) index[kids[i].token] = static_cast<uint32_t>(i);
    }
    kids.pop_back();
  }
};

inline int64_t Child::count() const { return node ? node->count : 1; }

struct Cursor {  // a growing suffix of a sequence: its deepest real node, that node's depth, its start
  Node* node;
  int64_t depth;
  int64_t start;
};

struct Position {  // where a token string ends in the trie: a node, or inside a tail at seq index q
  bool found = false;
  Node* node = nullptr;
  const Child* tail = nullptr;
  int64_t q = 0;
};

struct Draft {
  std::vector<Token> tokens;
  std::vector<double> probs;
  double score = 0.0;
  int64_t match_len = 0;
};

class SuffixTree {
 public:
  explicit SuffixTree(int64_t max_depth) : depth_(max_depth), root_(std::make_unique<Node>(0)) {}

  void extend(int64_t seq_id, const std::vector<Token>& tokens) {
    if (seqs_.count(seq_id) && !cursors_.count(seq_id))
      throw py::value_error("suffix tree: sequence " + std::to_string(seq_id) + " is sealed and cannot be extended");
    Seq& seq = seqs_[seq_id];  // unordered_map: the vector's address is stable while it exists
    auto& curs = cursors_[seq_id];
    const int64_t D = depth_;
    for (Token t : tokens) {
      const int64_t p = static_cast<int64_t>(seq.size());
      seq.push_back(t);
      curs.push_back({root_.get(), 0, p});
      for (auto& c : curs) {
        const int64_t a = c.depth;
        if (a != p - c.start) continue;  // this suffix runs on in its own tail, which grew with seq
        Node* node = c.node;
        Child* child = node->find(t);
        node->cont += 1;
        if (child == nullptr) {
          Child tail;
          tail.token = t, tail.stamp = stamp_++, tail.seq = &seq, tail.pos = p, tail.limit = c.start + D, tail.sid = seq_id;
          node->add(std::move(tail));
          if (node->kids.size() == 1) node->has_best = true, node->best = t;
          continue;
        }
        Node* cn = child->node.get();
        if (cn == nullptr) {  // a second occurrence: make the tail's first node real
          const Seq* s = child->seq;
          const int64_t q = child->pos + 1, limit = child->limit, sid = child->sid;
          child->node = std::make_unique<Node>(1);
          child->seq = nullptr;
          cn = child->node.get();
          if (q < std::min(static_cast<int64_t>(s->size()), limit)) {
            Child rest;
            rest.token = (*s)[q], rest.stamp = stamp_++, rest.seq = s, rest.pos = q, rest.limit = limit, rest.sid = sid;
            cn->add(std::move(rest));
            cn->cont = 1, cn->has_best = true, cn->best = (*s)[q];
          }
          auto owners = cursors_.find(sid);  // the owner's anchor moves down one node
          if (owners != cursors_.end() && !owners->second.empty()) {
            const int64_t j = limit - D - owners->second.front().start;
            if (0 <= j && j < static_cast<int64_t>(owners->second.size())) {
              owners->second[j].node = cn;
              owners->second[j].depth = a + 1;
            }
          }
        }
        cn->count += 1;
        if (node->has_best && node->best != t) {
          const Child* bc = node->find(node->best);
          if (bc->node == nullptr || cn->count > bc->node->count) node->best = t;
        }
        c.node = cn;
        c.depth = a + 1;
      }
      if (p - curs.front().start + 1 >= D) curs.pop_front();
    }
  }

  void seal(int64_t seq_id) { cursors_.erase(seq_id); }

  void remove(int64_t seq_id) {
    cursors_.erase(seq_id);
    auto it = seqs_.find(seq_id);
    if (it == seqs_.end()) return;
    const Seq& seq = it->second;
    const int64_t n = static_cast<int64_t>(seq.size()), D = depth_;
    for (int64_t start = 0; start < n; ++start) {
      Node* node = root_.get();
      for (int64_t q = start; q < std::min(n, start + D); ++q) {
        const Token t = seq[q];
        Child* child = node->find(t);
        if (child == nullptr) throw std::logic_error("suffix tree: remove found a count missing (corrupt tree)");
        node->cont -= 1;
        if (node->has_best && node->best == t) node->has_best = false;
        if (child->node == nullptr) {  // count 1: only this suffix runs through it
          node->erase(t);
          break;
        }
        child->node->count -= 1;
        if (child->node->count == 0) {
          node->erase(t);
          break;
        }
        node = child->node.get();
      }
    }
    seqs_.erase(it);
  }

  Draft speculate(const std::vector<Token>& context, int64_t k, double max_spec_factor, double min_token_prob) {
    const int64_t keep = depth_ > 1 ? depth_ - 1 : 0;
    const int64_t total = static_cast<int64_t>(context.size());
    const int64_t n = std::min(total, keep);
    const Token* ctx = context.data() + (total - n);
    int64_t lo = 0, hi = n;
    std::unordered_map<int64_t, Position> found;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      Position pos = match(ctx + n - mid, mid);
      bool continues = false;
      if (pos.found) {
        continues = pos.node ? pos.node->cont > 0
                             : pos.q < std::min(static_cast<int64_t>(pos.tail->seq->size()), pos.tail->limit);
      }
      if (continues) {
        lo = mid;
        found[mid] = pos;
      } else {
        hi = mid - 1;
      }
    }
    Draft best;
    for (int64_t m = lo; m > 0; --m) {
      const int64_t cap = std::min(k, static_cast<int64_t>(static_cast<double>(m) * max_spec_factor + 1e-6));
      if (static_cast<double>(cap) <= best.score) break;
      auto f = found.find(m);
      const Position pos = f != found.end() ? f->second : match(ctx + n - m, m);
      Draft d = draft(pos, cap, min_token_prob);
      if (d.score > best.score) {
        d.match_len = m;
        best = std::move(d);
      }
    }
    return best;
  }

  int64_t length(int64_t seq_id) const {
    auto it = seqs_.find(seq_id);
    return it == seqs_.end() ? 0 : static_cast<int64_t>(it->second.size());
  }

  Token token(int64_t seq_id, int64_t i) const {
    auto it = seqs_.find(seq_id);
    if (it == seqs_.end() || i < 0 || i >= static_cast<int64_t>(it->second.size()))
      throw py::index_error("SuffixTree.token: no such sequence position");
    return it->second[i];
  }

  std::vector<int64_t> seq_ids() const {
    std::vector<int64_t> ids;
    for (const auto& kv : seqs_) ids.push_back(kv.first);
    std::sort(ids.begin(), ids.end());
    return ids;
  }

  int64_t max_depth() const { return depth_; }

 private:
  Position match(const Token* tokens, int64_t n) const {
    Node* node = root_.get();
    int64_t i = 0;
    while (i < n) {
      const Child* child = node->find(tokens[i]);
      ++i;
      if (child == nullptr) return {};
      if (child->node) {
        node = child->node.get();
        continue;
      }
      const Seq& s = *child->seq;
      int64_t q = child->pos + 1;
      const int64_t end = std::min(static_cast<int64_t>(s.size()), child->limit);
      while (i < n) {
        if (q >= end || s[q] != tokens[i]) return {};
        ++q, ++i;
      }
      return {true, nullptr, child, q};
    }
    return {true, node, nullptr, 0};
  }

  static Token best_child(Node* node) {
    if (!node->has_best) {  // the most frequent child; ties: the one inserted first
      const Child* b = &node->kids[0];
      for (const auto& c : node->kids) {
        const int64_t cc = c.count(), bc = b->count();
        if (cc > bc || (cc == bc && c.stamp < b->stamp)) b = &c;
      }
      node->has_best = true;
      node->best = b->token;
    }
    return node->best;
  }

  static Draft draft(const Position& start, int64_t cap, double min_prob) {
    Draft d;
    double prob = 1.0;
    Node* node = start.node;
    const Child* tail = start.tail;
    int64_t q = start.q;
    while (static_cast<int64_t>(d.tokens.size()) < cap) {
      if (tail != nullptr) {  // inside a tail: count 1 all the way, the estimate stays
        const Seq& s = *tail->seq;
        const int64_t end = std::min(static_cast<int64_t>(s.size()), tail->limit);
        const int64_t take = std::min(end - q, cap - static_cast<int64_t>(d.tokens.size()));
        for (int64_t i = 0; i < take; ++i) {
          d.tokens.push_back(s[q + i]);
          d.probs.push_back(prob);
        }
        break;
      }
      if (node->cont == 0) break;
      const Token t = best_child(node);
      const Child* child = node->find(t);
      prob *= static_cast<double>(child->count()) / static_cast<double>(node->cont);
      if (prob < min_prob) break;
      d.tokens.push_back(t);
      d.probs.push_back(prob);
      if (child->node) {
        node = child->node.get();
      } else {
        tail = child;
        q = child->pos + 1;
      }
    }
    double score = 0.0;  // summed left to right, as SuffixTree._draft does
    for (double p : d.probs) score += p;
    d.score = score;
    return d;
  }

  int64_t depth_;
  std::unique_ptr<Node> root_;
  uint64_t stamp_ = 0;
  std::unordered_map<int64_t, Seq> seqs_;
  std::unordered_map<int64_t, std::deque<Cursor>> cursors_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<SuffixTree>(m, "SuffixTree")
      .def(py::init<int64_t>(), py::arg("max_depth"))
      .def("extend", &SuffixTree::extend, py::arg("seq_id"), py::arg("tokens"))
      .def("seal", &SuffixTree::seal, py::arg("seq_id"))
      .def("remove", &SuffixTree::remove, py::arg("seq_id"))
      .def("speculate",
           [](SuffixTree& t, const std::vector<Token>& context, int64_t k, double factor, double min_prob) {
             Draft d = t.speculate(context, k, factor, min_prob);
             return std::make_tuple(std::move(d.tokens), std::move(d.probs), d.score, d.match_len);
           },
           py::arg("context"), py::arg("k"), py::arg("max_spec_factor"), py::arg("min_token_prob"))
      .def("length", &SuffixTree::length, py::arg("seq_id"))
      .def("token", &SuffixTree::token, py::arg("seq_id"), py::arg("i"))
      .def("seq_ids", &SuffixTree::seq_ids)
      .def_property_readonly("max_depth", &SuffixTree::max_depth);
}
