// recserve-cpp-loader: proves a recserve artifact runs without Python, with the same answers.
//
//   recserve-cpp-loader ARTIFACT_DIR INPUTS.pt OUTPUTS.pt [--device cpu|cuda] [--fbgemm-dir DIR]
//
// INPUTS.pt: Python torch.save({"dense": f32[B,F], "values": i64[N], "lengths": i32[T*B]}).
// OUTPUTS.pt: {"ctr": forward(...), "pooled": lookup(...)}, readable by Python torch.load (weights_only too).
//
// Steps, as a C++ service would do them:
//  1. read manifest.json; check the sha256 of model.pt against it, and its rows against golden.pt's;
//  2. dlopen(RTLD_NOW | RTLD_GLOBAL) every fbgemm library the manifest lists, in its order: the
//     FBGEMM operators and TorchScript classes model.pt refers to are spread over ~15 shared objects
//     that register themselves with the dispatcher when loaded (loading only fbgemm_gpu_py.so fails
//     with unknown 'fbgemm' classes); RTLD_GLOBAL lets the later ones resolve symbols of the earlier;
//  3. torch::jit::load, then forward and lookup under NoGradGuard.
// Any failure is one line on stderr. Exit code 2: what the user can fix (usage; a file missing or
// unreadable; a manifest that is not JSON or lacks a key; a checksum or row count that does not match;
// inputs that do not fit the model; an fbgemm library not found; --device cuda without one). Exit
// code 1: an internal failure (libtorch cannot load a model.pt that matches its checksum, the model
// fails on inputs that passed the checks).
#include <dlfcn.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/passes/tensorexpr_fuser.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/cuda.h>
#include <torch/script.h>
#include <torch/serialize.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "mini_json.hpp"
#include "sha256.hpp"

namespace {

// What the user can fix: exit code 2. Any other exception is an internal failure: exit code 1.
struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// An error as one line. TorchScript's runtime errors open with "The following operation failed in
// the TorchScript interpreter." and a traceback through the scripted code; the line that says what
// went wrong ("RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x7 and 8x32)") is the last.
std::string one_line(const std::string& what) {
  std::vector<std::string> lines;
  std::istringstream in(what);
  for (std::string line; std::getline(in, line);) {
    if (line.find_first_not_of(" \t\r") != std::string::npos) lines.push_back(line);
  }
  if (lines.empty()) return "unknown error";
  if (lines.size() > 1 && lines.front().rfind("The following operation failed in the TorchScript", 0) == 0) {
    return "the model failed in the TorchScript interpreter: " + lines.back();
  }
  return lines.front();
}

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError(path + ": cannot open (missing?)");
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// torch::pickle_save tags dicts with torch.jit._pickle.restore_type_tag, which Python's
// torch.load(weights_only=True) - the default since torch 2.6 - refuses. The same archive written by
// an untagged Pickler holds only what weights_only allows: a plain dict of tensors.
std::vector<char> save_for_python(const c10::IValue& value) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler(
      [&](const char* buf, size_t n) { pickled.insert(pickled.end(), buf, buf + n); }, nullptr, nullptr, nullptr,
      nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::vector<char> archive;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) {
    const char* bytes = static_cast<const char*>(data);
    archive.insert(archive.end(), bytes, bytes + n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
  writer.writeEndOfFile();
  return archive;
}

void open_fbgemm(const mini_json::Value& manifest, const std::string& dir) {
  for (const auto& lib : manifest.at("fbgemm_libraries").array) {
    std::string path = dir + "/" + lib.string;
    if (!dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      const char* why = dlerror();
      throw UserError("cannot load fbgemm library " + path + ": " + (why ? why : "unknown error") +
                    " (pass --fbgemm-dir with the fbgemm_gpu package directory)");
    }
  }
}

torch::Tensor input(const c10::Dict<c10::IValue, c10::IValue>& dict, const std::string& name,
                    c10::ScalarType dtype, int64_t dim) {
  if (!dict.contains(name)) throw UserError("INPUTS.pt lacks \"" + name + "\" (needs dense, values, lengths)");
  const auto& v = dict.at(name);
  if (!v.isTensor()) throw UserError("INPUTS.pt: \"" + name + "\" is not a tensor");
  auto t = v.toTensor();
  if (t.scalar_type() != dtype)
    throw UserError("INPUTS.pt: \"" + name + "\" has dtype " + std::string(c10::toString(t.scalar_type())) +
                  ", expected " + c10::toString(dtype));
  if (t.dim() != dim)
    throw UserError("INPUTS.pt: \"" + name + "\" has " + std::to_string(t.dim()) + " dimension(s), expected " +
                  std::to_string(dim));
  // torch.save keeps a view's strides (values = ids[:, 0]); the kernels read the buffer as if dense.
  return t.contiguous();
}

// The lookup kernels run without bounds checks (TorchRec's inference sharders): the inputs must fit
// together and the tables before they reach them, as the server checks them (serving/frontend/validate.py).
void check_kjt(const mini_json::Value& manifest, const torch::Tensor& dense, const torch::Tensor& values,
               const torch::Tensor& lengths) {
  const auto& features = manifest.at("features").array;
  const int64_t t = static_cast<int64_t>(features.size()), b = dense.size(0);
  const auto width = static_cast<int64_t>(manifest.at("dense_features").number);
  if (dense.size(1) != width)
    throw UserError("INPUTS.pt: \"dense\" has " + std::to_string(dense.size(1)) + " features per sample, the model " +
                    std::to_string(width) + " (manifest.json dense_features)");
  if (lengths.numel() != t * b)
    throw UserError("INPUTS.pt: \"lengths\" has " + std::to_string(lengths.numel()) + " entries, expected " +
                  std::to_string(t) + " features x " + std::to_string(b) + " samples (key-major)");
  auto per_bag = lengths.to(torch::kCPU).to(torch::kInt64);
  if (b && per_bag.min().item<int64_t>() < 0) throw UserError("INPUTS.pt: \"lengths\" has a negative length");
  const int64_t total = per_bag.sum().item<int64_t>();
  if (total != values.numel())
    throw UserError("INPUTS.pt: \"lengths\" sum to " + std::to_string(total) + " ids, \"values\" has " +
                  std::to_string(values.numel()));
  auto ids = values.to(torch::kCPU);
  auto per_feature = per_bag.view({t, b}).sum(1);
  int64_t at = 0;
  for (int64_t f = 0; f < t; ++f) {
    const int64_t n = per_feature[f].item<int64_t>();
    const auto rows = static_cast<int64_t>(features[f].at("rows").number);
    if (n > 0) {
      auto slice = ids.slice(0, at, at + n);
      const int64_t lo = slice.min().item<int64_t>(), hi = slice.max().item<int64_t>();
      if (lo < 0 || hi >= rows)
        throw UserError("INPUTS.pt: feature \"" + features[f].at("name").string + "\" has id " +
                      std::to_string(lo < 0 ? lo : hi) + ", outside its table's " + std::to_string(rows) + " rows");
    }
    at += n;
  }
}

// The path of a file of the artifact whose sha256 is the manifest's.
std::string checked_file(const mini_json::Value& manifest, const std::string& artifact, const std::string& name) {
  const std::string path = artifact + "/" + name;
  const std::string expected = manifest.at("files").at(name).string;
  std::string actual;
  try {
    actual = sha256::file_hexdigest(path);
  } catch (const std::runtime_error& e) {
    throw UserError(std::string(e.what()) + " (missing?)");
  }
  if (actual != expected) throw UserError(path + ": sha256 " + actual + " does not match the manifest's " + expected);
  return path;
}

// The manifest is not covered by the checksums, and check_kjt takes each table's rows from it: each
// feature's rows must be those of the table in the artifact, whose last row is the largest id of the
// feature in golden.pt (checksummed; the export puts it there), as the server checks them
// (serving/engine/loader.py check_golden_shapes).
void check_rows(const mini_json::Value& manifest, const std::string& artifact) {
  auto golden = torch::pickle_load(read_file(checked_file(manifest, artifact, "golden.pt"))).toGenericDict();
  const auto& features = manifest.at("features").array;
  const int64_t t = static_cast<int64_t>(features.size());
  const int64_t b = golden.at("dense").toTensor().size(0);
  auto lengths = golden.at("lengths").toTensor().to(torch::kInt64);
  auto ids = golden.at("values").toTensor();
  if (lengths.numel() != t * b)
    throw UserError("manifest.json: " + std::to_string(t) + " features, but golden.pt's inputs have " +
                  std::to_string(b ? lengths.numel() / b : 0));
  auto per_feature = lengths.view({t, b}).sum(1);
  int64_t at = 0;
  for (int64_t f = 0; f < t; ++f) {
    const int64_t n = per_feature[f].item<int64_t>();
    const auto rows = static_cast<int64_t>(features[f].at("rows").number);
    if (b > 1 && n > 0) {
      const int64_t table_rows = ids.slice(0, at, at + n).max().item<int64_t>() + 1;
      if (table_rows != rows)
        throw UserError("manifest.json: features[" + std::to_string(f) + "].rows is " + std::to_string(rows) +
                      ", but the table of feature \"" + features[f].at("name").string + "\" in the artifact has " +
                      std::to_string(table_rows) + " rows (golden.pt's largest id + 1)");
    }
    at += n;
  }
}

int run(const std::string& artifact, const std::string& inputs_path, const std::string& outputs_path,
        const std::string& device_name, const std::string& fbgemm_dir) {
  std::ifstream manifest_file(artifact + "/manifest.json");
  if (!manifest_file) throw UserError(artifact + "/manifest.json: cannot open (missing?)");
  std::stringstream text;
  text << manifest_file.rdbuf();
  mini_json::Value manifest = mini_json::parse(text.str());

  const std::string model_path = checked_file(manifest, artifact, "model.pt");
  check_rows(manifest, artifact);

  open_fbgemm(manifest, fbgemm_dir);

  torch::Device device(device_name);
  if (device.is_cuda() && !torch::cuda::is_available()) throw UserError("--device cuda: no CUDA device is visible");
  // An artifact exported with --dense-dtype tf32 expects TF32 matmuls (as Python loaders set them).
  const auto& dense_dtype = manifest.at("dense_dtype").string;
  at::globalContext().setAllowTF32CuBLAS(dense_dtype == "tf32");
  // As recserve.manifest.set_dense_math: TorchScript's TensorExpr fuser off (slower than ATen here).
  torch::jit::setTensorExprFuserEnabled(false);
  torch::jit::Module module = torch::jit::load(model_path, device);
  module.eval();

  c10::IValue loaded;
  const auto inputs_bytes = read_file(inputs_path);
  try {
    loaded = torch::pickle_load(inputs_bytes);
  } catch (const c10::Error& e) {
    throw UserError(inputs_path + ": not a file of torch.save (" + one_line(e.what_without_backtrace()) + ")");
  }
  if (!loaded.isGenericDict()) throw UserError(inputs_path + ": expected a dict of tensors");
  auto dict = loaded.toGenericDict();
  auto dense = input(dict, "dense", torch::kFloat32, 2).to(device);
  auto values = input(dict, "values", torch::kInt64, 1).to(device);
  auto lengths = input(dict, "lengths", torch::kInt32, 1).to(device);
  check_kjt(manifest, dense, values, lengths);

  torch::NoGradGuard no_grad;
  auto ctr = module.forward({dense, values, lengths}).toTensor().to(torch::kCPU);
  auto pooled = module.get_method("lookup")({values, lengths}).toTensor().to(torch::kCPU);

  c10::Dict<std::string, torch::Tensor> out;
  out.insert("ctr", ctr);
  out.insert("pooled", pooled);
  auto bytes = save_for_python(out);
  std::ofstream file(outputs_path, std::ios::binary);
  if (!file) throw UserError(outputs_path + ": cannot write");
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!file) throw UserError(outputs_path + ": write failed");
  std::printf("ok: batch %lld, ctr [%lld], pooled [%lld, %lld] on %s\n", static_cast<long long>(dense.size(0)),
              static_cast<long long>(ctr.size(0)), static_cast<long long>(pooled.size(0)),
              static_cast<long long>(pooled.size(1)), device_name.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> positional;
  std::string device = "cpu";
  std::string fbgemm_dir = RECSERVE_FBGEMM_DIR;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--device" || a == "--fbgemm-dir") {
      if (i + 1 == argc) {
        std::cerr << "recserve-cpp-loader: error: option " << a << " needs a value\n";
        return 2;
      }
      (a == "--device" ? device : fbgemm_dir) = argv[++i];
    } else if (a.rfind("--", 0) == 0) {
      std::cerr << "recserve-cpp-loader: error: unknown option " << a << "\n";
      return 2;
    } else {
      positional.push_back(a);
    }
  }
  if (positional.size() != 3 || (device != "cpu" && device != "cuda")) {
    std::cerr << "usage: recserve-cpp-loader ARTIFACT_DIR INPUTS.pt OUTPUTS.pt [--device cpu|cuda] [--fbgemm-dir DIR]\n";
    return 2;
  }
  try {
    return run(positional[0], positional[1], positional[2], device, fbgemm_dir);
  } catch (const UserError& e) {
    std::cerr << "recserve-cpp-loader: error: " << one_line(e.what()) << "\n";
    return 2;
  } catch (const mini_json::Error& e) {
    std::cerr << "recserve-cpp-loader: error: " << one_line(e.what()) << "\n";
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "recserve-cpp-loader: error: " << one_line(e.what_without_backtrace()) << "\n";
  } catch (const std::exception& e) {
    std::cerr << "recserve-cpp-loader: error: " << one_line(e.what()) << "\n";
  } catch (...) {
    std::cerr << "recserve-cpp-loader: error: unknown error\n";
  }
  return 1;
}
